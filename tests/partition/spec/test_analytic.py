"""Analytical per-layer profile against hand-computed numbers."""

import pytest

from partition.spec.analytic import RNG_STATE_BYTES as R
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import DeviceSpec, device_spec
from partition.spec.models import MODELS, ModelSpec
from partition.spec.profile import Profile

TINY = ModelSpec("tiny", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16)
DEV = DeviceSpec("test-dev", peak_tflops=1.0, memory_bytes=1 << 30, pcie_gbps=10.0)  # R = 5e11 at mfu 0.5


def test_tiny_fp16_by_hand():
    p = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp16", mfu=0.5)
    assert [x.name for x in p.layers] == ["embedding", "block", "block", "head"]
    assert (p.model, p.device, p.dtype, p.microbatch_size, p.seq_len) == ("tiny", "test-dev", "fp16", 3, 4)
    emb, blk, _, head = p.layers
    # params: 16*8 + 4*8 ; 12*64 + 13*8 ; 16*8 + 2*8
    assert (emb.param_count, blk.param_count, head.param_count) == (160, 872, 144)
    assert (emb.param_bytes, blk.param_bytes, head.param_bytes) == (320, 1744, 288)
    # flops: 2*3*4*8 ; 2*3*4*768 + 4*3*16*8 ; 2*3*4*8*16
    assert (emb.fwd_flops, blk.fwd_flops, head.fwd_flops) == (192.0, 19968.0, 3072.0)
    assert (emb.bwd_flops, blk.bwd_flops, head.bwd_flops) == (384.0, 39936.0, 6144.0)
    # activations: 8*s*(b + 1) = 8*4*4 (int64 ids and positions) ; s*b*(2N + A + e*f*(p + 1)) + L, N = 2eh + 8,
    # A = e*(2h + 2h), p = 1 (gelu), L = 4*a*b*32 (the log-sum-exp, rows padded to 32), R = 24 (half precision on a
    # gpu: the random state) = 12*(80 + 64 + 128) + 768 + 24 ; s*b*(N + 4V + 8) + 4 = 12*(40 + 64 + 8) + 4
    assert (emb.activation_bytes, blk.activation_bytes, head.activation_bytes) == (128, 4032 + R, 1348) and R == 24
    # outputs: s*b*h*e ; s*b*V*e = 4*3*16*2
    assert (emb.output_bytes, blk.output_bytes, head.output_bytes) == (192, 192, 384)
    assert blk.fwd_s == pytest.approx(19968 / 5e11, rel=1e-12)
    assert blk.bwd_s == pytest.approx(39936 / 5e11, rel=1e-12)
    assert head.fwd_s == pytest.approx(3072 / 5e11, rel=1e-12)


def test_dtype_scaling():
    h = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp16")
    b = analytic_profile(TINY, DEV, microbatch_size=3, dtype="bf16")
    f = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp32")
    assert [x.param_bytes for x in h.layers] == [x.param_bytes for x in b.layers]
    for x16, x32 in zip(h.layers, f.layers):
        assert x32.param_bytes == 2 * x16.param_bytes
        assert x32.output_bytes == 2 * x16.output_bytes
        assert x32.fwd_flops == x16.fwd_flops
    assert f.layers[0].activation_bytes == h.layers[0].activation_bytes  # int64 ids and positions in both
    for i in (1, 2):  # the norms' statistics and the log-sum-exp are fp32 in both
        assert f.layers[i].activation_bytes == 12 * (2 * (2 * 4 * 8 + 8) + 4 * 32 + 4 * 32 * 2) + 4 * 2 * 3 * 32
    # the head: its norm's input and output in the dtype; the fp32 log-softmax, statistics, targets in both
    assert f.layers[-1].activation_bytes == 2 * 4 * 3 * 8 * 4 + 4 * 3 * 16 * 4 + 16 * 4 * 3 + 4


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"fp8.*fp16.*bf16.*fp32"):
        analytic_profile(TINY, DEV, dtype="fp8")


@pytest.mark.parametrize("kw", [{"microbatch_size": 0}, {"microbatch_size": 1.5}, {"mfu": 0.0}, {"mfu": 1.5}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        analytic_profile(TINY, DEV, **kw)


def test_gpt3_175b_on_3090ti():
    spec = MODELS["gpt3-175b"]
    p = analytic_profile(spec, device_spec("RTX 3090 Ti"))
    assert p.num_layers == spec.num_layers == 98
    assert sum(x.param_count for x in p.layers) == spec.param_count
    blk = p.layers[1]
    s, h, a = 2048, 12288, 96
    assert blk.activation_bytes == s * (2 * (2 * 2 * h + 8) + 2 * 4 * h + 2 * 4 * h * 2) + 4 * a * s + R
    assert blk.fwd_s == pytest.approx((24 * s * h * h + 4 * s * s * h) / 40e12)
    assert 0.15 < blk.fwd_s < 0.25  # ~7.6 TFLOP per block at 40 TFLOP/s


def test_profile_round_trips():
    p = analytic_profile(TINY, DEV, microbatch_size=2)
    assert Profile.from_dict(p.to_dict()) == p


TINY_LLAMA = ModelSpec(
    "tl", num_blocks=2, d_model=8, num_heads=4, seq_len=5, vocab_size=16, family="llama", ffn_dim=12, num_kv_heads=2
)


def test_tiny_llama_by_hand():
    p = analytic_profile(TINY_LLAMA, DEV, microbatch_size=3, dtype="fp16", mfu=0.5)
    emb, blk, _, head = p.layers
    assert (emb.param_count, blk.param_count, head.param_count) == (128, 496, 136)
    # matmul weights m = 2d^2 + 2d*k*hd + 3df = 128 + 64 + 288; fwd = 2*b*s*m + 4*b*s^2*h
    assert blk.fwd_flops == 2 * 3 * 5 * 480 + 4 * 3 * 25 * 8 == 16800.0
    assert blk.bwd_flops == 33600.0
    # s*b*(2N + A + e*f*(p + 3)) + L + 2*e*hd*s: N = 4h + 2eh + 4 (RMSNorm's fp32 copy), A = e*(2h + 2*k*hd),
    # p = 1 (silu), L = 4*a*b*32, the rotary tables 2*e*hd*s, R
    assert blk.activation_bytes == 15 * (2 * 68 + 48 + 96) + 4 * 4 * 3 * 32 + 2 * 2 * 2 * 5 + R == 5776 + R
    # the embedding: 8*s*b (the ids; a llama has no positions); the head: s*b*(N + 4V + 8) + 4
    assert (emb.activation_bytes, emb.output_bytes, blk.output_bytes) == (8 * 5 * 3, 240, 240)
    assert (head.activation_bytes, head.output_bytes) == (15 * (68 + 4 * 16 + 8) + 4, 15 * 16 * 2)
    assert blk.fwd_s == pytest.approx(16800 / 5e11, rel=1e-12)


def test_gpt_mlp_width_generalizes_the_korthikanti_count():
    wide = ModelSpec("w", num_blocks=1, d_model=8, num_heads=2, seq_len=4, vocab_size=16, ffn_dim=20)
    blk = analytic_profile(wide, DEV, microbatch_size=3).layers[1]
    # s*b*(2N + A + 2ef) + L + R = 12*(80 + 64 + 80) + 4*2*3*32 + R ; fwd 2*b*s*(4h^2 + 2hf) + 4*b*s^2*h
    assert blk.activation_bytes == 12 * (80 + 64 + 80) + 768 + R
    assert blk.fwd_flops == 2 * 12 * (256 + 320) + 4 * 3 * 16 * 8
    same = ModelSpec("tiny", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16, ffn_dim=32)
    assert analytic_profile(same, DEV, 3) == analytic_profile(TINY, DEV, 3)


def test_llama2_70b_on_a100():
    spec = MODELS["llama2-70b"]
    p = analytic_profile(spec, device_spec("A100-SXM4-80GB"))
    assert p.num_layers == 82 and sum(x.param_count for x in p.layers) == spec.param_count
    blk = p.layers[1]
    s, h = 4096, 8192
    m = 2 * h * h + 2 * h * 8 * 128 + 3 * h * 28672
    assert blk.fwd_flops == 2 * s * m + 4 * s * s * h
    norm, attention, mlp = 4 * h + 2 * 2 * h + 4, 2 * (2 * h + 2 * 8 * 128), 2 * 28672 * 4
    assert blk.activation_bytes == s * (2 * norm + attention + mlp) + 4 * 64 * s + 2 * 2 * 128 * s + R
    assert 1.0 < blk.fwd_flops / 1e12 < 10.0  # ~7.3 TFLOP per block and sequence


def test_an_fp32_profile_runs_at_the_fp32_rate_where_the_table_knows_it():
    """Without TF32 an fp32 matmul runs on CUDA cores: an A100's 19.5 TFLOP/s, not its 312 of bf16 tensor cores; a
    device without an fp32 figure (a layout's, the probe's: bf16) keeps its one rate."""
    a100 = device_spec("A100-SXM4-80GB")
    f, b = (analytic_profile(TINY, a100, microbatch_size=3, dtype=d, mfu=0.5) for d in ("fp32", "bf16"))
    assert f.layers[1].fwd_flops == b.layers[1].fwd_flops
    assert f.layers[1].fwd_s == pytest.approx(f.layers[1].fwd_flops / (19.5e12 * 0.5), rel=1e-12)
    assert b.layers[1].fwd_s == pytest.approx(b.layers[1].fwd_flops / (312e12 * 0.5), rel=1e-12)
    assert (a100.tflops("fp32"), a100.tflops("fp16"), DEV.tflops("fp32")) == (19.5, 312.0, 1.0)
    with pytest.raises(ValueError, match="fp32_tflops must be >= 0"):
        DeviceSpec("x", 1.0, 0, 1.0, fp32_tflops=-1.0)


@pytest.mark.parametrize("dtype, e", [("fp16", 2), ("fp32", 4)])
def test_a_dropout_mask_takes_a_byte_on_a_gpu_and_the_dtypes_width_on_the_stand_in(dtype, e):
    """GPT-2's residual dropouts (two masks a block) and its embedding dropout (one): CUDA's fused dropout keeps a
    bool, the CPU's a noise tensor in the dtype (DeviceSpec.fused_dropout); attention's dropout off here."""
    from dataclasses import replace

    dropped = replace(TINY, resid_dropout=0.1, embd_dropout=0.1)
    standin = replace(DEV, fused_dropout=False)
    t, h = 3 * 4, TINY.d_model
    for device, m in ((DEV, 1), (standin, e)):
        plain = analytic_profile(TINY, device, microbatch_size=3, dtype=dtype).layers
        more = analytic_profile(dropped, device, microbatch_size=3, dtype=dtype).layers
        grown = [y.activation_bytes - x.activation_bytes for x, y in zip(plain, more)]
        assert grown == [t * m * h, t * 2 * m * h, t * 2 * m * h, 0]
    assert device_spec("cpu-standin").mask_bytes(e) == e and device_spec("NVIDIA H200").mask_bytes(e) == 1
