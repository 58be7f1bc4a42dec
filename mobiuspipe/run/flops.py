"""Model FLOPs of a training step, the rate a run reaches (TFLOPS) and its share of the devices' peak (MFU).

Legend (units in brackets):
  L    num_blocks                                                        [-]
  h    d_model                                                           [-]
  s    seq_len, tokens per sequence                                      [-]
  V    vocab_size                                                        [-]
  m    block_matmul_params (partition.spec.models; gpt: 12h^2)                [-]
  F    model FLOPs per token, forward + backward                        [FLOP]
  T    tokens per optimizer step: batch_size * s                        [-]
  t    the step's wall time on rank 0                                    [s]
  P_g  peak_tflops of rank g's device (partition.spec.hardware)               [1e12 FLOP/s]

F comes from the partition package's analytic cost model (partition.spec.analytic: per layer fwd_flops, and
bwd_flops = 2 * fwd_flops), summed over the layers for one sequence and divided by s:
  F = 3 * (2*L*m + 4*L*s*h + 2*h + 2*h*V) = 6*(L*m + h*V) + 12*L*s*h + 6*h
that is 6N over the N = L*m + h*V weights of the matmuls (biases and norms left out; the embedding tables
are a gather, charged 6h), plus the attention scores QK^T and their weighted sum AV, 12*L*s*h, over the
full s x s (not halved for the causal mask). This is the usual MFU convention (Chowdhery et al. 2022,
PaLM, appendix B; Narayanan et al. 2021, Megatron-LM): the plan's recompute is NOT counted, so MFU is
what the model needs, not what the hardware did (that would be HFU).
  step FLOPs  F * T
  TFLOPS      F * T / t / 1e12
Under LoRA the frozen base computes no weight gradient: F is summed from the analytic profile with the run's
adapters (partition.spec.analytic, its LoRA paragraph: the base's backward is one forward's FLOPs, the adapters'
matmuls are added), about 2/3 of the full fine-tuning F.
  MFU         TFLOPS / sum_g P_g          (P_g is the dense fp16/bf16 tensor rate whatever train.precision;
                                           the CPU stand-in's entry is 0.05, about 50 GFLOP/s of fp32)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from partition.spec.analytic import analytic_profile
from partition.spec.hardware import DEVICES, device_spec
from partition.spec.models import ModelSpec

__all__ = ["flops_per_token", "device_name", "peak_tflops", "rate"]

CPU_STANDIN = "cpu-standin"
"""The hardware table's name of the CPU stand-in device."""


def flops_per_token(spec: ModelSpec, adapters: Sequence[int] | None = None) -> float:
    """F of the legend: model FLOPs (forward + backward, no recompute) per token of `spec`, with LoRA `adapters`
    (parameters per layer) when given."""
    # The FLOP counts do not depend on the device or the dtype (they set only the seconds and bytes).
    profile = analytic_profile(spec, DEVICES[CPU_STANDIN], microbatch_size=1, dtype="fp32", adapters=adapters)
    return sum(layer.fwd_flops + layer.bwd_flops for layer in profile.layers) / spec.seq_len


def device_name(local_rank: int) -> str:
    """The device type a rank on this host drives: the CUDA device's name, or the CPU stand-in."""
    return torch.cuda.get_device_name(local_rank) if torch.cuda.is_available() else CPU_STANDIN


def peak_tflops(name: str) -> float | None:
    """P of the legend for device type `name`; None when partition/spec/hardware.py does not list it (then a run
    reports no MFU)."""
    try:
        return device_spec(name).peak_tflops
    except ValueError:  # an unknown device: MFU is not defined, the run goes on without it
        return None


def rate(step_flops: float, step_s: float, peaks: list[float | None]) -> tuple[float, float | None]:
    """(TFLOPS, MFU) of a step of step_flops model FLOPs that took step_s seconds on ranks whose devices
    peak at `peaks` (TFLOPS each); MFU is None when a device's peak is unknown."""
    tflops = step_flops / step_s / 1e12 if step_s > 0 else 0.0
    known = [p for p in peaks if p is not None]
    if not known or len(known) < len(peaks):
        return tflops, None
    return tflops, tflops / sum(known)
