"""The measured profiler on real layers on the CPU, against the analytic profile of the same spec."""

from typing import Any

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.models.gpt import build_layers, lm_loss
from mobiuspipe.profiling.profiler import TORCH_DTYPES, home_of, measure_layers, measure_profile
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.models import ModelSpec
from partition.spec.profile import Profile, compress

SPEC = ModelSpec("tiny", num_blocks=6, d_model=64, num_heads=4, seq_len=32, vocab_size=97)
B = 2
FAST = dict(warmup=1, min_repeats=3, max_repeats=10)


def _kw(**more) -> dict[str, Any]:
    return dict(
        device="cpu",
        name=SPEC.name,
        device_name="cpu-standin",
        dtype_name="fp32",
        microbatch_size=B,
        seq_len=SPEC.seq_len,
        **FAST,
        **more,
    )


@pytest.fixture(scope="module")
def measured():
    layers = build_layers(SPEC, seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(SPEC.vocab_size, (B, SPEC.seq_len), generator=g)
    targets = torch.randint(SPEC.vocab_size, (B, SPEC.seq_len), generator=g)
    return measure_layers(
        [layers[l] for l in range(SPEC.num_layers)], tokens, **_kw(loss_fn=lambda logits: lm_loss(logits, targets))
    )


@pytest.fixture(scope="module")
def analytic():
    return analytic_profile(SPEC, device_spec("cpu-standin"), microbatch_size=B, dtype="fp32")


def test_header_and_layer_names(measured):
    p = measured.profile
    assert (p.model, p.device, p.dtype, p.microbatch_size, p.seq_len) == ("tiny", "cpu-standin", "fp32", B, 32)
    assert [x.name for x in p.layers] == ["embedding"] + ["block"] * 6 + ["head"]


def test_only_three_distinct_layers_are_run(measured):
    assert measured.measured == (0, 1, 7)
    assert measured.source == (0, 1, 1, 1, 1, 1, 1, 7)
    assert [n for _, n in compress(measured.profile)] == [1, 6, 1]


def test_param_bytes_equal_the_analytic_profile(measured, analytic):
    for m, a in zip(measured.profile.layers, analytic.layers, strict=True):
        assert (m.param_count, m.param_bytes) == (a.param_count, a.param_bytes)
        assert m.output_bytes == a.output_bytes


def test_times_are_positive(measured):
    for x in measured.profile.layers:
        assert x.fwd_s > 0 and x.bwd_s > 0
        assert x.recompute_s is not None and x.recompute_s > 0  # timed apart: with grad, through the hooks
    *kept, last = measured.profile.layers
    assert all(x.kept_s is not None and x.kept_s > 0 for x in kept)
    assert last.kept_s is None and last.keep_s == last.recompute_s  # fused with its loss: never a keep F


def test_the_layers_are_called_as_the_runtime_calls_them(monkeypatch):
    # Stage.forward calls functional_call; the recompute runs under the ledger's counting hook
    import mobiuspipe.profiling.profiler as profiler

    # and a kept forward under the keep hooks, with its parameters in one weight slot, microbatches in a row
    calls, counted, kept = [], [], []
    real_call, real_counting, real_keeping = profiler.functional_call, profiler.counting_saved, profiler.keeping

    def keeping(ledger, key, slot, slot_at_b):
        kept.append((key, slot.dtype, slot.numel(), len(ledger.keys("kept"))))  # the graphs held before it
        return real_keeping(ledger, key, slot, slot_at_b)

    monkeypatch.setattr(profiler, "functional_call", lambda *a, **k: calls.append(1) or real_call(*a, **k))
    monkeypatch.setattr(profiler, "counting_saved", lambda ledger: counted.append(1) or real_counting(ledger))
    monkeypatch.setattr(profiler, "keeping", keeping)
    layer = nn.Linear(8, 8)
    kw = _kw() | dict(warmup=0, min_repeats=1, max_repeats=1, microbatches=3)
    measure_profile([layer], torch.randn(2, 8), **kw)
    assert len(calls) == 2 + 3 and len(counted) == 1  # a forward visit, a recompute and 3 kept forwards
    # the slot holds the 72 parameters' bytes; each kept forward starts with the earlier ones' graphs held
    # (a Linear saves its input: one held tensor each, its weight a reference into the slot)
    assert kept == [(("kept", i), torch.uint8, 72 * 4, i) for i in range(3)]


def test_matmul_flops_match_the_analytic_count(measured, analytic):
    # FlopCounterMode counts matmuls and attention: the block's forward is the analytic 2*b*s*12h^2 + 4*b*s^2*h.
    m, a = measured.profile.layers, analytic.layers
    assert m[1].fwd_flops == pytest.approx(a[1].fwd_flops, rel=1e-9)
    assert m[-1].fwd_flops == pytest.approx(a[-1].fwd_flops, rel=1e-9)
    assert 1.5 < m[1].bwd_flops / m[1].fwd_flops < 2.5
    assert m[0].fwd_flops == 0.0  # a gather: no FLOPs counted (the analytic profile charges 2*b*s*h)


def test_activation_bytes_against_the_analytic_estimate(measured, analytic):
    """Observed (torch 2.13, CPU, fp32): every layer to the byte. The block's count is what autograd saves, tensor by
    tensor (the norms' inputs, outputs and fp32 statistics, Q, K, V, the attention's output and fp32 log-sum-exp,
    the MLP's input, gelu's input and the last matmul's input; the built-in GPT has no dropout); before, Korthikanti
    et al.'s count with its dropout masks was 6% above it (and 0.73 of it with their 5as^2b of scores). The
    embedding (token ids and positions) and the head (the LayerNorm's input and output, the fp32 log-softmax, the
    norm's statistics, the targets, the loss's total weight) to the byte too."""
    m, a = measured.profile.layers, analytic.layers
    assert [x.activation_bytes for x in m] == [x.activation_bytes for x in a]


@pytest.mark.parametrize("dtype, b", [("fp32", 3), ("bf16", 1)])
def test_the_end_layers_estimates_cover_what_they_keep_at_odd_sizes(dtype, b):
    """The embedding and the head (its loss on fp32 logits, as the runtime computes it) at odd sizes: the estimate
    is what they keep in fp32, and at most 1% above it in bf16 (the norm's statistics are counted in fp32)."""
    spec = ModelSpec("odd", num_blocks=1, d_model=40, num_heads=5, seq_len=19, vocab_size=203)
    layers = build_layers(spec, seed=1)
    ends = [layers[0].to(TORCH_DTYPES[dtype]), layers[2].to(TORCH_DTYPES[dtype])]
    g = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(spec.vocab_size, (b, spec.seq_len), generator=g) for _ in range(2))
    embedding_out = ends[0](tokens)
    kw = dict(device="cpu", name="odd", device_name="cpu-standin", dtype_name=dtype, microbatch_size=b, **FAST)
    got = [
        measure_profile([ends[0]], tokens, seq_len=spec.seq_len, **kw).layers[0],
        measure_profile(
            [ends[1]], embedding_out, seq_len=spec.seq_len, loss_fn=lambda out: lm_loss(out.float(), targets), **kw
        ).layers[0],
    ]
    want = analytic_profile(spec, device_spec("cpu-standin"), microbatch_size=b, dtype=dtype).layers
    for m, a in zip(got, (want[0], want[2])):
        ratio = a.activation_bytes / m.activation_bytes
        assert ratio == 1.0 if dtype == "fp32" else 1.0 <= ratio <= 1.01, (m.name, ratio)


def test_saved_bytes_of_a_known_module():
    layer = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    p = measure_profile(
        [layer],
        torch.randn(3, 4),
        device="cpu",
        name="m",
        device_name="cpu-standin",
        dtype_name="fp32",
        microbatch_size=3,
        seq_len=1,
        **FAST,
    )
    x = p.layers[0]
    assert isinstance(p, Profile) and x.name == "sequential"
    assert x.activation_bytes == 3 * 4 * 4 + 3 * 8 * 4  # Linear's input and ReLU's output; the weight is a param
    assert (x.param_count, x.param_bytes, x.output_bytes) == (40, 160, 96)
    assert x.fwd_flops == 2 * 3 * 4 * 8


def test_a_microbatch_cut_from_a_batch_counts_its_own_bytes():
    """A Pipeline profiles one microbatch of the sample batch, a slice of it: what the first layer saves of its input
    is that microbatch's bytes, as the runtime holds it (each microbatch copied on its own), not the batch's storage
    (the embedding of a 3-microbatch run counted 3x its token ids); the loss's saved targets likewise."""

    def run(batch: int) -> tuple[int, ...]:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
        x, y = torch.randn(batch, 4), torch.randn(batch, 2)
        with Pipeline(layers, nn.functional.mse_loss, sample=(x, y), num_microbatches=batch // 3, num_stages=2) as p:
            return tuple(s.activation_bytes for s in p.plan.stages)

    assert run(12) == run(3)


class _SavesOffDevice(torch.autograd.Function):
    """ReLU that also saves a tensor off the measured device for its backward, as CUDA's flash and
    memory-efficient attention kernels save their philox seed and offset: 0-d int64 tensors in host memory."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, torch.zeros(1 << 16, dtype=torch.int64, device="meta"))
        return x.relu()

    @staticmethod
    def backward(ctx, g):
        x, _ = ctx.saved_tensors
        return g * (x > 0)


class _OffDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 8)

    def forward(self, x):
        return _SavesOffDevice.apply(self.linear(x))


def test_saved_bytes_count_only_the_measured_devices_memory():
    """What a layer keeps in host memory (CUDA attention's philox seeds) takes none of the gpu's: on a GPU the 16
    bytes of every attention put each HF layer's measured bytes above the count by as much."""
    p = measure_profile([_OffDevice()], torch.randn(3, 4), **{**_kw(), "dtype_name": "fp32", "microbatch_size": 3})
    assert p.layers[0].activation_bytes == 3 * 4 * 4 + 3 * 8 * 4  # the Linear's input and the ReLU's


class _Attention(nn.Module):
    """q of 4 heads against k and v of `kv` heads (grouped-query attention when kv < 4, as Llama's and Qwen2's)."""

    def __init__(self, kv: int, expand: bool = False):
        super().__init__()
        self.kv, self.expand = kv, expand
        self.q, self.k, self.v = nn.Linear(24, 24), nn.Linear(24, 6 * kv), nn.Linear(24, 6 * kv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 6).transpose(1, 2)
        k, v = (f(x).view(b, s, self.kv, 6).transpose(1, 2) for f in (self.k, self.v))
        if self.expand:  # the reference: every head its own k and v, the same arithmetic
            k, v = (t.repeat_interleave(4 // self.kv, dim=1) for t in (k, v))
        gqa = self.kv != 4 and not self.expand
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)


def _equal_heads(count):
    """torch 2.11's sdpa flop formula (the GPU image's torch): query, key and value must have as many heads."""

    def counted(*shapes, **kwargs):
        q, k, v = shapes[-3:] if len(shapes) == 3 else shapes[1:4]
        if not q[1] == k[1] == v[1]:
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return count(*shapes, **kwargs)

    return counted


@pytest.mark.parametrize("equal_heads", [False, True])
def test_grouped_query_attention_is_counted_as_its_heads_compute(monkeypatch, equal_heads):
    """A GQA layer's flops equal those of the same attention with k and v repeated to the query's heads, also on a
    torch whose sdpa formulas need equal heads (2.11 refuses GQA there; 2.13 counts it at the query's heads)."""
    from torch.utils import flop_counter

    if equal_heads:
        monkeypatch.setattr(flop_counter, "sdpa_flop_count", _equal_heads(flop_counter.sdpa_flop_count))
        monkeypatch.setattr(
            flop_counter, "sdpa_backward_flop_count", _equal_heads(flop_counter.sdpa_backward_flop_count)
        )
    torch.manual_seed(0)
    x = torch.randn(2, 13, 24)
    kw = _kw(loss_fn=None) | {"name": "gqa", "microbatch_size": 2, "seq_len": 13}
    gqa, mha = (measure_profile([_Attention(2, expand)], x, **kw).layers[0] for expand in (False, True))
    assert gqa.fwd_flops == mha.fwd_flops > 2 * 2 * 13 * 24 * 48  # the projections and the attention's matmuls
    assert gqa.bwd_flops == mha.bwd_flops


def test_same_layer_type_on_a_new_input_shape_is_measured_again():
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)]
    m = measure_layers(layers, torch.randn(2, 8), **_kw())
    assert m.measured == (0, 2, 3)


def test_dtype_must_match_the_parameters():
    with pytest.raises(ValueError, match="fp16"):
        measure_layers([nn.Linear(2, 2)], torch.randn(1, 2), **{**_kw(), "dtype_name": "fp16"})
    with pytest.raises(ValueError, match="fp8"):
        measure_layers([nn.Linear(2, 2)], torch.randn(1, 2), **{**_kw(), "dtype_name": "fp8"})


@pytest.mark.parametrize("bad", [{"min_repeats": 0}, {"max_repeats": 2}, {"warmup": -1}, {"rel_tol": 0.0}])
def test_bad_repeat_arguments(bad):
    with pytest.raises(ValueError, match="min_repeats"):
        measure_layers([nn.Linear(2, 2)], torch.randn(1, 2), **{**_kw(), **bad})
    with pytest.raises(ValueError, match="at least one layer"):
        measure_layers([], torch.randn(1, 2), **_kw())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_layers_return_to_the_cpu():
    layer = nn.Linear(64, 64).half()
    p = measure_profile([layer], torch.randn(4, 64).half(), **{**_kw(), "device": "cuda", "dtype_name": "fp16"})
    assert p.layers[0].fwd_s > 0 and next(layer.parameters()).device.type == "cpu"


def test_a_layer_goes_back_where_its_buffers_were():
    """A layer with buffers and no parameters (a positional encoding's table) goes back where the buffers were after
    its measurement, not to the measuring device (on CUDA rank 0's gpu, where no plan counts it)."""
    table = nn.Module()
    table.register_buffer("pe", torch.zeros(4, 3, device="meta"))
    assert home_of(table) == torch.device("meta")
    assert home_of(nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert home_of(nn.ReLU()) is None  # nothing to move
