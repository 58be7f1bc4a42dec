"""What an adapted model's layers keep for backward, measured on the runtime's path, against the profile a LoRA run
plans from (mobiuspipe.startup.config_plan.gpt_profile): never more than counted."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.config import config_from_dict
from mobiuspipe.lora.layers import add_adapters
from mobiuspipe.models import gpt, hf
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.profiling.profiler import TORCH_DTYPES, measure_layers
from mobiuspipe.startup.config_plan import gpt_profile, model_spec
from mobiuspipe.startup.lora import lora_spec

S, B, VOCAB = 19, 3, 301  # hf_fixtures.VOCAB
TARGETS = {
    "gpt": ["qkv", "proj", "fc", "out"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
"""Every linear layer of a block; None in a test: PEFT's defaults (qkv, c_attn; q_proj and v_proj)."""
LOWEST = 0.95
"""The least share of its count an adapted layer keeps on the stand-in: the count follows what the frozen base keeps
(no input of a frozen linear layer unless an adapter or another op keeps it, no frozen norm's normalized values)."""
SIZES = {
    "gpt2": dict(n_embd=40, n_head=5, n_inner=72, n_layer=2, n_positions=S, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0),
    "llama": dict(hidden_size=40, intermediate_size=67, num_attention_heads=4, num_key_value_heads=2),
}


def _run(tmp_path, hf_kit, kind: str, dropout: float, precision: str, every: bool = True):
    """The config's profile and its layers as a rank builds them, adapted (every linear layer of a block, or PEFT's
    default targets) and in the training dtype."""
    lora = {"rank": 4, "dropout": dropout} | ({"targets": TARGETS[kind]} if every else {})
    if kind == "gpt":
        model = {"num_blocks": 2, "d_model": 40, "num_heads": 5, "seq_len": S, "vocab_size": VOCAB}
    else:
        hf_kit.save_model(kind, tmp_path / kind, seed=2, **SIZES[kind])
        model = {"hf": kind, "seq_len": S}
    doc = {"model": model, "train": {"precision": precision}, "plan": {"num_gpus": 1}, "lora": lora}
    cfg = config_from_dict(doc, base_dir=tmp_path)
    if kind == "gpt":
        made = [gpt.build_layers(model_spec(cfg), seed=0)[l] for l in range(model_spec(cfg).num_layers)]
    else:
        made = [f() for f in hf.layer_factories(hf.open_hf(tmp_path / kind, S))]
    spec = lora_spec(cfg)
    assert spec is not None
    for layer in made:
        add_adapters(layer, spec)
    return cfg, [layer.to(TORCH_DTYPES[precision]).train() for layer in made]


@pytest.mark.parametrize("every", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama"])
def test_an_adapted_layer_keeps_what_the_plan_counts(tmp_path, hf_kit, kind, dropout, precision, every):
    """An adapter keeps its A's output (r values a token, which B keeps) and, with dropout, the dropped input (A
    keeps it) and the mask; the frozen base keeps no input of its own, its norms no normalized values, its
    embedding nothing: each layer keeps [LOWEST, 1] of its count (the embedding none)."""
    cfg, layers = _run(tmp_path, hf_kit, kind, dropout, precision, every)
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    measured = measure_layers(
        layers,
        x,
        device="cpu",
        name=kind,
        device_name="cpu-standin",
        dtype_name=precision,
        microbatch_size=B,
        seq_len=S,
        loss_fn=lambda out: lm_loss(out.float(), y),
        warmup=0,
        min_repeats=1,
        max_repeats=1,
    ).profile.layers
    counted = gpt_profile(cfg, microbatch_size=B).layers
    assert measured[0].activation_bytes == counted[0].activation_bytes == 0  # a frozen embedding
    for l, (got, want) in enumerate(zip(measured[1:], counted[1:], strict=True), start=1):
        assert LOWEST * want.activation_bytes <= got.activation_bytes <= want.activation_bytes, (
            f"layer {l} ({got.name}): kept {got.activation_bytes} B, counted {want.activation_bytes} B"
        )
