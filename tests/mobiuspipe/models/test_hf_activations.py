"""What a Hugging Face model's layers keep for backward, measured on the runtime's path, against the analytic profile
a `model.hf` run plans from: never more than counted, and not far less."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import layer_factories, open_hf
from mobiuspipe.profiling.profiler import TORCH_DTYPES, measure_layers
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec

VOCAB = 301  # hf_fixtures.VOCAB
S, B = 37, 3  # odd sizes
SIZES = {
    "gpt2": dict(n_embd=40, n_head=5, n_inner=72, n_layer=2, n_positions=S),
    "llama": dict(hidden_size=40, intermediate_size=67, num_attention_heads=4, num_key_value_heads=2),
}
DROPOUT = {"gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1), "llama": dict(attention_dropout=0.1)}
LOWEST = 0.95
"""The least share of its count a layer keeps on the stand-in: the count is an upper bound (a norm's statistics
counted in fp32, a CUDA kernel's padded log-sum-exp), not a loose guess. (A dropout's mask is counted as each device
keeps it: in the dtype on the stand-in, a bool on a GPU: DeviceSpec.fused_dropout.)"""


def _layers(tmp_path, hf_kit, kind: str, dtype: str, **over):
    family = "gpt2" if kind == "gpt2" else "llama"
    size = SIZES[family] | ({} if family == "gpt2" else dict(num_hidden_layers=2, max_position_embeddings=S))
    if kind == "mistral":
        size["sliding_window"] = S
    hf_kit.save_model(kind, tmp_path / "m", seed=3, **size, **over)
    m = open_hf(tmp_path / "m", S)
    return m, [f().to(TORCH_DTYPES[dtype]).train() for f in layer_factories(m)]


def _measured_and_counted(m, layers, dtype: str):
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    measured = measure_layers(
        layers,
        x,
        device="cpu",
        name=m.spec.name,
        device_name="cpu-standin",
        dtype_name=dtype,
        microbatch_size=B,
        seq_len=S,
        loss_fn=lambda out: lm_loss(out.float(), y),  # as the runtime computes its loss
        warmup=0,
        min_repeats=1,
        max_repeats=1,
    ).profile
    counted = analytic_profile(m.spec, device_spec("cpu-standin"), microbatch_size=B, dtype=dtype)
    return measured.layers, counted.layers


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "kind, over",
    [
        ("gpt2", {}),
        ("gpt2", DROPOUT["gpt2"]),
        ("gpt2", {"activation_function": "relu"}),
        ("gpt2", {"activation_function": "gelu_pytorch_tanh"}),
        ("llama", {}),
        ("llama", DROPOUT["llama"]),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_a_layer_keeps_at_most_what_the_plan_counts(tmp_path, hf_kit, kind, over, dtype):
    """GPT-2's `gelu_new` (transformers' tanh formula, four tensors of the MLP's width kept where torch's gelu keeps
    one), its dropouts (masks; attention's through the stand-in's math kernel, which keeps the s x s probabilities:
    CPU's fused kernel takes no dropout), the Llama family's RMSNorm (an fp32 copy of its input beside the
    normalized output) and rotary tables, and the log-sum-exp's fp32 values: each layer's kept bytes within
    [LOWEST, 1] of its count; with GPT-2's other activations too."""
    m, layers = _layers(tmp_path, hf_kit, kind, dtype, **over)
    measured, counted = _measured_and_counted(m, layers, dtype)
    for l, (got, want) in enumerate(zip(measured, counted, strict=True)):
        ratio = got.activation_bytes / want.activation_bytes
        assert LOWEST <= ratio <= 1.0, (
            f"layer {l} ({got.name}): kept {got.activation_bytes} B, counted {want.activation_bytes} B"
        )


def test_fp32_grouped_query_attention_reaches_sdpa_with_every_head(tmp_path, hf_kit, monkeypatch):
    """On CUDA, fp32 attention with fewer key/value heads than query heads runs the math kernel (flash and cuDNN take
    fp16/bf16 only, the memory-efficient kernel refuses grouped queries: torch's sdp_utils), which keeps the
    (b, a, s, s) probabilities; the layers give it the key/value heads repeated instead, in fp32 only, and the logits
    are still transformers'."""
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kwargs):
        seen.append((q.dtype, q.shape[1], k.shape[1], v.shape[1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    model = hf_kit.save_model("llama", tmp_path / "ref", seed=5).eval()
    m = open_hf(tmp_path / "ref", 17)
    for dtype, groups in ((torch.float32, 1), (torch.bfloat16, 2)):
        layers = [f().to(dtype) for f in layer_factories(m)]
        x = torch.randint(0, VOCAB, (2, 17))
        seen.clear()
        with torch.no_grad():
            hidden = x
            for layer in layers:
                hidden = layer(hidden)
        assert seen and all(q // k == q // v == groups for _, q, k, v in seen), seen
        if dtype == torch.float32:
            with torch.no_grad():
                want = model(x).logits
            torch.testing.assert_close(hidden, want, rtol=0, atol=1e-6)
