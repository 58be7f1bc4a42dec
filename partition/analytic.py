"""Analytical per-layer profile of a GPT (FLOPs, bytes, seconds) on a device type, without running it.

Legend (for ONE microbatch; units in brackets):
  s    seq_len, tokens per sequence                                                    [-]
  b    microbatch_size, sequences per microbatch                                       [-]
  h    d_model, hidden size                                                            [-]
  a    num_heads                                                                       [-]
  V    vocab_size                                                                      [-]
  e    bytes per element: 2 for fp16/bf16, 4 for fp32                                  [bytes]
  n_l  parameters of layer l (partition.models.layer_param_counts)                     [-]
  R    = peak_tflops * 1e12 * mfu: sustained rate of the device                        [FLOP/s]

Per layer l (names "embedding", "block", "head"):
  param_bytes       n_l * e
  fwd_flops         block      2*b*s*(12h^2) + 4*b*s^2*h   (the four matmuls with 12h^2 weights, two
                                                            FLOPs per multiply-add, plus QK^T and AV;
                                                            Narayanan et al. 2021, Megatron-LM, FLOP count)
                    embedding  2*b*s*h                     (a token charge: one gather and one add per
                                                            output element, so the layer is not free)
                    head       2*b*s*h*V                   (the logits matmul)
  bwd_flops         2 * fwd_flops                          (input and weight gradients, same matmuls)
  fwd_s, bwd_s      fwd_flops / R, bwd_flops / R
  activation_bytes  block      s*b*h*(34 + 5*a*s/h) * e/2  (Korthikanti et al. 2022, "Reducing Activation
                                                            Recomputation in Large Transformer Models",
                                                            no sequence or tensor parallelism;
                                                            their count is for 2-byte activations)
                    embedding  s*b*h*e                     (the summed embeddings, input of the first block)
                    head       s*b*h*e + s*b*V*4           (the normalized input, fp32 logits for the loss)
  output_bytes      embedding, block  s*b*h*e ;  head  s*b*V*e
LayerNorm and bias FLOPs are left out (under 1% of a block for h >= 512).
"""

from __future__ import annotations

from partition.hardware import MFU_DEFAULT, DeviceSpec
from partition.models import ModelSpec, layer_param_counts
from partition.profile import LayerProfile, Profile

__all__ = ["DTYPE_BYTES", "analytic_profile", "dtype_bytes"]

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
"""e of the legend for each accepted dtype."""


def dtype_bytes(dtype: str) -> int:
    """e for `dtype`; ValueError naming the accepted dtypes otherwise."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _check_args(microbatch_size: int, mfu: float) -> None:
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size <= 0:
        raise ValueError(f"microbatch_size must be a positive integer, found {microbatch_size!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], found {mfu!r}; {MFU_DEFAULT} is the documented default")


def _layer(name: str, n: int, e: int, act: int, out: int, fwd_flops: float, rate: float) -> LayerProfile:
    bwd_flops = 2.0 * fwd_flops
    return LayerProfile(name=name, param_count=n, param_bytes=n * e, activation_bytes=act, output_bytes=out,
                        fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_s=fwd_flops / rate, bwd_s=bwd_flops / rate)


def analytic_profile(spec: ModelSpec, device: DeviceSpec, microbatch_size: int = 1, dtype: str = "fp16",
                     mfu: float = MFU_DEFAULT) -> Profile:
    """Profile of `spec` on `device` for microbatches of `microbatch_size` sequences (see the legend)."""
    e = dtype_bytes(dtype)
    _check_args(microbatch_size, mfu)
    s, b, h, a, v = spec.seq_len, microbatch_size, spec.d_model, spec.num_heads, spec.vocab_size
    rate = device.peak_tflops * 1e12 * mfu
    counts = layer_param_counts(spec)
    hidden = s * b * h * e
    # s*b*h*(34 + 5*a*s/h) * e/2, kept integral: e is even, 34*h + 5*a*s is an integer.
    block_act = s * b * (34 * h + 5 * a * s) * (e // 2)
    block_flops = float(2 * b * s * 12 * h * h + 4 * b * s * s * h)
    embedding = _layer("embedding", counts[0], e, hidden, hidden, float(2 * b * s * h), rate)
    blocks = [_layer("block", n, e, block_act, hidden, block_flops, rate) for n in counts[1:-1]]
    head = _layer("head", counts[-1], e, hidden + s * b * v * 4, s * b * v * e, float(2 * b * s * h * v), rate)
    return Profile(model=spec.name, device=device.name, dtype=dtype, microbatch_size=b, seq_len=s,
                   layers=(embedding, *blocks, head))
