"""X_l, what a layer's backward allocates beyond what its forward kept: the analytic profile's count on a gpu
against the tensors the layer's backward makes, counted op by op on the CPU (tests/mobiuspipe/transients.py): never
less than they hold at once, and not far more; trained, frozen (LoRA's base) and with adapters; odd sizes."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.lora.layers import add_adapters
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.gpt import build_layer, lm_loss
from mobiuspipe.models.hf import layer_factories, open_hf
from mobiuspipe.profiling.profiler import TORCH_DTYPES
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import LIBRARY_BYTES, device_spec
from partition.spec.lora import LoraShape, adapter_counts
from partition.spec.models import ModelSpec
from tests.mobiuspipe.transients import bool_mask_dropout, measured_transients

GPU = device_spec("NVIDIA GeForce RTX 4090")
LOOSEST = 1.3
"""The most a count may exceed what the layer's tensors hold at once (an embedding's count leaves out what its
backward frees)."""
LOOSEST_LORA = 1.5
"""With adapters: an adapted down projection keeps its input for the adapter's gradient, whose freeing makes room the
count (a frozen base's) does not credit."""


def _check(layers, x, y, counted, frozen: bool = False, loosest: float = LOOSEST, forward: bool = False) -> None:
    """Each layer's measured X_l within [counted / loosest, counted]; its input the previous layer's output."""
    for l, (layer, want) in enumerate(zip(layers, counted.layers, strict=True)):
        if frozen:
            for p in layer.parameters():
                p.requires_grad_(False)
        if l == 0 and not any(p.requires_grad for p in layer.parameters()):  # a frozen embedding has no backward
            assert want.workspace_bytes == 0
        else:
            loss = (lambda out: lm_loss(out.float(), y)) if l == len(layers) - 1 else None
            got = measured_transients(layer, x, loss, forward)
            assert got <= want.workspace_bytes <= loosest * got, (l, got, want.workspace_bytes)
        with torch.no_grad():
            x = layer(x)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("h, a, s, b, vocab", [(48, 3, 37, 3, 301), (96, 4, 13, 1, 1003), (40, 5, 101, 2, 77)])
def test_the_built_in_gpt_needs_at_most_the_transients_counted(h, a, s, b, vocab, frozen, dtype):
    """Sequences longer and shorter than the width (the MLP's activation backward or a weight's gradient the most),
    vocabularies larger and smaller than the tokens (the loss's gradients or the logits' weight gradient)."""
    spec = ModelSpec("t", 2, h, a, s, vocab)
    g = torch.Generator().manual_seed(h * s + b)
    layers = [build_layer(spec, 1, l).to(TORCH_DTYPES[dtype]) for l in range(spec.num_layers)]
    x, y = (torch.randint(0, vocab, (b, s), generator=g) for _ in range(2))
    adapters = [0] * spec.num_layers if frozen else None  # a frozen base: LoRA's, its adapters left out
    _check(layers, x, y, analytic_profile(spec, GPU, b, dtype, adapters=adapters), frozen)


S, B, VOCAB = 37, 3, 301  # hf_fixtures.VOCAB
SIZES = {
    "gpt2": dict(n_embd=40, n_head=5, n_inner=72, n_layer=2, n_positions=S),
    "llama": dict(hidden_size=40, intermediate_size=67, num_attention_heads=4, num_key_value_heads=2),
}


def _hf(tmp_path, hf_kit, kind: str, dtype: str, **over):
    family = "gpt2" if kind == "gpt2" else "llama"
    size = SIZES[family] | ({} if family == "gpt2" else dict(num_hidden_layers=2, max_position_embeddings=S))
    hf_kit.save_model(kind, tmp_path / "m", seed=3, **(size | over))
    m = open_hf(tmp_path / "m", S)
    return m, [f().to(TORCH_DTYPES[dtype]).train() for f in layer_factories(m)]


NARROW = dict(hidden_size=64, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2)
"""A llama whose MLP is narrower than its width: the RMSNorm's fp32 backward holds the most."""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize(
    "kind, over",
    [
        ("gpt2", {}),
        ("gpt2", {"activation_function": "relu"}),
        ("gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}),
        ("llama", {}),
        ("llama", {"hidden_act": "relu"}),
        ("llama", NARROW),
        ("qwen2", {}),
    ],
)
def test_hugging_face_layers_need_at_most_the_transients_counted(tmp_path, hf_kit, kind, over, frozen, dtype):
    """GPT-2's gelu_new (a chain of elementwise ops) and Conv1D, another activation, its residual and embedding
    dropouts with CUDA's bool masks (attention's dropout runs inside CUDA's fused kernels, not the CPU's), the
    Llama family's SwiGLU (a relu gate too) and its fp32 RMSNorm."""
    m, layers = _hf(tmp_path, hf_kit, kind, dtype, **over)
    g = torch.Generator().manual_seed(7)
    x, y = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    adapters = [0] * len(layers) if frozen else None
    with bool_mask_dropout():
        _check(layers, x, y, analytic_profile(m.spec, GPU, B, dtype, adapters=adapters), frozen)


@pytest.mark.parametrize("base_dtype", [None, "int8", "nf4"])
@pytest.mark.parametrize(
    "kind, targets", [("gpt2", ("c_attn", "c_fc")), ("llama", ("q_proj", "down_proj")), ("llama", ("lm_head",))]
)
def test_lora_layers_need_at_most_the_transients_counted(tmp_path, hf_kit, kind, targets, base_dtype):
    """Adapters (with dropout) on attention, MLP and head linears, the base frozen in the dtype or quantized: the
    adapters' gradients and the dequantized weight beside a linear's gradients, the forward's own transients too."""
    from mobiuspipe.lora.quant import quantize_frozen
    from partition.spec.lora import frozen_layers

    m, layers = _hf(tmp_path, hf_kit, kind, "bf16")
    lora = LoraSpec(rank=4, alpha=8.0, targets=targets, dropout=0.1)
    for layer in layers:
        add_adapters(layer, lora, torch.Generator().manual_seed(1))
        if base_dtype is not None:
            quantize_frozen(layer, base_dtype)
    g = torch.Generator().manual_seed(8)
    x, y = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    counts = adapter_counts(m.spec, LoraShape(4, targets, 0.1))
    frozen = None if base_dtype is None else frozen_layers(m.spec, 2, base_dtype)
    counted = analytic_profile(m.spec, GPU, B, "bf16", adapters=counts, frozen=frozen)
    with bool_mask_dropout():
        _check(layers, x, y, counted, loosest=LOOSEST_LORA, forward=True)


def test_a_gpu_profile_holds_the_libraries_workspace_and_the_stand_in_none():
    """W: a gpu's profile carries the device's library_bytes (measured on an H200) beside each layer's X; the
    stand-in's ledger counts no transients, so its profile has none."""
    spec = ModelSpec("t", 2, 48, 3, 37, 301)
    gpu, standin = analytic_profile(spec, GPU, 3, "bf16"), analytic_profile(spec, device_spec("cpu-standin"), 3, "bf16")
    assert gpu.library_bytes == LIBRARY_BYTES > 0
    assert all(x.workspace_bytes > 0 for x in gpu.layers)
    assert standin.library_bytes == 0 and all(x.workspace_bytes == 0 for x in standin.layers)


RELEASED = dict(hidden_size=40, intermediate_size=108, num_attention_heads=4, num_key_value_heads=2)
"""A llama whose MLP is 2.7 times its width, as the narrowest released ones (Llama-2's 2.69; Mistral's 3.5)."""
SQUARE = dict(hidden_size=40, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
"""A llama whose MLP is as wide as the model: the forward's fp32 norm weighs most against the backward's count."""


@pytest.mark.parametrize("lora", [None, ("q_proj", "down_proj")])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("dtype,size", [("bf16", RELEASED), ("bf16", SQUARE), ("fp32", SQUARE)])
def test_the_forwards_own_transients_are_within_the_count(tmp_path, hf_kit, frozen, lora, dtype, size):
    """A forward's own transients (transformers' RMSNorm computes in fp32, up to three fp32 t x h tensors at once),
    which a gpu's allocator sees, stay within the count with an MLP 2.7 times the width and as wide as the model, in
    bf16 and fp32: under the backward's without adapters; with them by the one MLP-wide tensor more the count gives
    an adapted block (without it, 1.10x at 2.7 times)."""
    m, layers = _hf(tmp_path, hf_kit, "llama", dtype, **size)
    g = torch.Generator().manual_seed(9)
    x, y = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    counts = None
    if lora is not None:
        for layer in layers:
            add_adapters(
                layer, LoraSpec(rank=4, alpha=8.0, targets=lora, dropout=0.1), torch.Generator().manual_seed(1)
            )
        counts = adapter_counts(m.spec, LoraShape(4, lora, 0.1))
    elif frozen:
        counts = [0] * len(layers)
        for layer in layers:
            for p in layer.parameters():
                p.requires_grad_(False)
    counted = analytic_profile(m.spec, GPU, B, dtype, adapters=counts)
    with torch.no_grad():
        hidden = layers[0](x)
    with bool_mask_dropout():
        for layer, want in zip(layers[1:-1], counted.layers[1:-1]):
            assert measured_transients(layer, hidden, forward=True) <= want.workspace_bytes
            with torch.no_grad():
                hidden = layer(hidden)
