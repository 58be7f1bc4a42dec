"""GPU spec table: peak mixed-precision throughput, memory and host link of each known device type.

Units: peak_tflops in 1e12 FLOP/s, memory_bytes in bytes, pcie_gbps in GB/s (1e9 bytes/s, one direction).

peak_tflops is the DENSE (no 2:4 sparsity) fp16/bf16 tensor-core rate with fp32 accumulate, the rate
mixed-precision training runs at. GeForce cards run fp32 accumulate at half their fp16-accumulate rate,
so their figure is half of the headline number. Sources (vendor documents):
  RTX 3090 / 3090 Ti   NVIDIA Ampere GA102 GPU Architecture whitepaper, "Peak FP16 Tensor TFLOPS with FP32
                       Accumulate": 71 (3090); 3090 Ti = 84 SMs x 1.86 GHz x 512 FLOP/clk/SM = 80
  RTX 4090             NVIDIA Ada GPU Architecture whitepaper (AD102), same row: 165.2
  A100 (all variants)  NVIDIA A100 Tensor Core GPU datasheet, "FP16/BF16 Tensor Core": 312
  H100 PCIe / SXM5     NVIDIA H100 Tensor Core GPU datasheet, "FP16 Tensor Core" 1,513 / 1,979 with
                       sparsity -> 756 / 989 dense
  H200 SXM             NVIDIA H200 Tensor Core GPU datasheet, "BF16 Tensor Core" 1,979 with sparsity -> 989
                       dense; 141 GB (NVML's name "NVIDIA H200", seen with 143,771 MiB)
  V100 SXM2            NVIDIA Tesla V100 datasheet, "Tensor Performance": 125
fp32_tflops is the dense fp32 rate on CUDA cores (non-tensor), what an fp32 run's matmuls get: torch leaves TF32
off for matmuls by default and mobiuspipe does not turn it on. Sources: the same documents' FP32 rows: 3090 35.6;
3090 Ti 84 SMs x 128 FP32 units x 2 x 1.86 GHz = 40.0; 4090 82.6; A100 19.5; H100 PCIe 51, SXM5 67; H200 67;
V100 15.7.
PCIe per direction: 3.0 x16 = 8 GT/s x 16 x 128/130 / 8 = 15.75 GB/s; 4.0 x16 = 31.5; 5.0 x16 = 63.0.
Memory is the marketing size in GiB, what NVML reports up to a few MiB of reserve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from types import MappingProxyType

from foundation.units import GiB, MiB
from topology import Topology

__all__ = ["DEVICES", "DeviceSpec", "LIBRARY_BYTES", "MFU_DEFAULT", "device_spec", "gpu_spec", "topology_gpu_spec"]

MFU_DEFAULT = 0.5
"""Model FLOPs utilization: the fraction of peak_tflops a well-fed layer (large matmuls, microbatch
of full sequences) reaches. An assumption, not a measurement: Narayanan et al. 2021 (Megatron-LM,
"Efficient Large-Scale Language Model Training on GPU Clusters", Table 1) reach 44-52% of peak on A100
for GPT models of 1.7B-1T parameters. A measured profile replaces it."""

_PCIE3, _PCIE4, _PCIE5 = 15.75, 31.5, 63.0

STANDIN_FORWARD_CALL_S = 330e-6
"""A CPU stand-in's forward_call_s: the tiny GPT of scripts/run.sh (d_model 64), traced by
scripts/bench_standin_plans.py on this project's 2-core VM, took 309-341 us more per layer forward than a linear
fit of its microbatch size predicts (BENCHMARKS.md)."""

LIBRARY_BYTES = 65 * MiB
"""A gpu's W (partition.spec.profile's library_bytes) where no profile measured it: what cuBLAS and cuBLASLt keep
for the compute stream, measured on an H200 with torch 2.11 (gpu_check, 2026-11-29: 65.0 MiB; torch's default
workspaces on Hopper are 32 MiB each, cuBLASLt's apart from cuBLAS's). Other gpus' defaults are smaller (cuBLAS's
8.125 MiB before Hopper), so it bounds them [bytes]."""


@dataclass(frozen=True)
class DeviceSpec:
    """Spec sheet of one device type (not one physical GPU: see topology.types.Gpu for that)."""

    name: str
    """As NVML reports it, e.g. "NVIDIA GeForce RTX 3090 Ti"; "cpu-standin" for the CPU stand-in."""
    peak_tflops: float
    """Dense fp16/bf16 tensor throughput with fp32 accumulate, 1e12 FLOP/s."""
    memory_bytes: int
    """Device memory; 0 means "take it from the topology" (the CPU stand-in's budget)."""
    pcie_gbps: float
    """Host<->device link bandwidth, one direction, GB/s."""
    forward_call_s: float = 0.0
    """Seconds each layer's forward call costs beyond its FLOPs as mobiuspipe runs it (the Python of the call: the
    parameter views, functional_call, the saved-tensor hooks; the backward runs in autograd's engine), charged to
    every forward and recompute [s]. A GPU's is 0: its launches overlap the kernels queued before them."""
    fp32_tflops: float = 0.0
    """Dense fp32 throughput without tensor cores, 1e12 FLOP/s (an fp32 run's rate); 0: unknown (a GPU the table
    does not list, with neither a layout's fp32_tflops nor a probe's fp32 rate: its fp32 plans use peak_tflops, an
    optimistic rate)."""
    fused_dropout: bool = True
    """The device runs CUDA's fused dropout: F.dropout keeps a bool mask (1 byte an element: native_dropout), and
    SDPA's flash and memory-efficient kernels apply attention's dropout keeping the random generator's state, not a
    mask. False (the CPU stand-in): F.dropout multiplies by a noise tensor in the activations' dtype, which it keeps,
    and attention with dropout runs the math kernel, which keeps the (b, a, s, s) probabilities (the CPU's flash
    kernel takes no dropout)."""
    holds_transients: bool = True
    """The device's memory holds what a computing layer allocates beyond its kept activations (its X_l: gradients
    of its intermediates, a weight's gradient before it is added in), which a plan holds apart. False: the CPU
    stand-in, whose ledger counts no transients."""
    library_bytes: int = LIBRARY_BYTES
    """W: what the math libraries keep on the device for the compute stream (LIBRARY_BYTES; 0 on the stand-in)
    [bytes]."""

    def __post_init__(self) -> None:
        if not self.fp32_tflops >= 0:
            raise ValueError(f"device {self.name!r}: fp32_tflops must be >= 0 (0: unknown), found {self.fp32_tflops}")
        if self.library_bytes < 0:
            raise ValueError(f"device {self.name!r}: library_bytes must be >= 0, found {self.library_bytes}")
        if not self.peak_tflops > 0 or not self.pcie_gbps > 0 or self.memory_bytes < 0 or not self.forward_call_s >= 0:
            raise ValueError(
                f"device {self.name!r}: need peak_tflops > 0, pcie_gbps > 0, memory_bytes >= 0 and forward_call_s "
                f">= 0, found {self.peak_tflops}, {self.pcie_gbps}, {self.memory_bytes} and {self.forward_call_s}"
            )

    def mask_bytes(self, e: int) -> int:
        """Bytes a dropout keeps per element of activations of e bytes (fused_dropout)."""
        return 1 if self.fused_dropout else e

    def tflops(self, dtype: str) -> float:
        """The matmul rate a run in `dtype` ("fp16", "bf16", "fp32") gets, 1e12 FLOP/s: fp32_tflops for fp32 where
        known, else peak_tflops."""
        return self.fp32_tflops if dtype == "fp32" and self.fp32_tflops > 0 else self.peak_tflops

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DeviceSpec:
        return cls(**d)


STANDIN = "cpu-standin"
"""The CPU stand-in's device name."""

_TABLE = (
    DeviceSpec("NVIDIA GeForce RTX 3090", 71.0, 24 * GiB, _PCIE4, fp32_tflops=35.6),
    DeviceSpec("NVIDIA GeForce RTX 3090 Ti", 80.0, 24 * GiB, _PCIE4, fp32_tflops=40.0),
    DeviceSpec("NVIDIA GeForce RTX 4090", 165.2, 24 * GiB, _PCIE4, fp32_tflops=82.6),
    DeviceSpec("Tesla V100-SXM2-32GB", 125.0, 32 * GiB, _PCIE3, fp32_tflops=15.7),
    DeviceSpec("NVIDIA A100-SXM4-40GB", 312.0, 40 * GiB, _PCIE4, fp32_tflops=19.5),
    DeviceSpec("NVIDIA A100-SXM4-80GB", 312.0, 80 * GiB, _PCIE4, fp32_tflops=19.5),
    DeviceSpec("NVIDIA A100-PCIE-40GB", 312.0, 40 * GiB, _PCIE4, fp32_tflops=19.5),
    DeviceSpec("NVIDIA A100 80GB PCIe", 312.0, 80 * GiB, _PCIE4, fp32_tflops=19.5),
    DeviceSpec("NVIDIA H100 PCIe", 756.0, 80 * GiB, _PCIE5, fp32_tflops=51.0),
    DeviceSpec("NVIDIA H100 80GB HBM3", 989.0, 80 * GiB, _PCIE5, fp32_tflops=67.0),
    DeviceSpec("NVIDIA H200", 989.0, 141 * GiB, _PCIE5, fp32_tflops=67.0),
    # A CPU pretending to be a GPU (CI, laptops): ~50 GFLOPS of fp32 matmul on a few cores; its memory
    # budget comes from the topology (the stand-in's arena), its "link" is a memcpy. Each layer's forward costs
    # STANDIN_FORWARD_CALL_S beyond its FLOPs.
    DeviceSpec(
        STANDIN, 0.05, 0, 10.0, STANDIN_FORWARD_CALL_S, fused_dropout=False, holds_transients=False, library_bytes=0
    ),
)

DEVICES: MappingProxyType[str, DeviceSpec] = MappingProxyType({d.name: d for d in _TABLE})
"""Known device types by their exact NVML name, read-only."""


def _short(name: str) -> str:
    """Lower case, whitespace collapsed, without the "NVIDIA " and "GeForce " prefixes."""
    s = " ".join(name.split()).lower()
    for prefix in ("nvidia ", "geforce "):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    return s


_BY_SHORT = MappingProxyType({_short(n): d for n, d in DEVICES.items()})


def gpu_spec(
    name: str,
    memory_bytes: int,
    link_gbps: float,
    tflops: float = 0.0,
    measured_tflops: float = 0.0,
    fp32_tflops: float = 0.0,
    measured_fp32_tflops: float = 0.0,
) -> DeviceSpec:
    """The spec of one gpu of a topology: its own figures where it gives tflops (a GPU the table does not list,
    as a layout file describes it), else the table's by its name, else its own figures with the matmul rate
    `topology --probe` measured as its peak (measured_tflops > 0; a lower bound of the datasheet's peak). Its fp32
    rate likewise: the layout's fp32_tflops, else the table's (for a gpu it lists), else the probe's fp32 matmul
    rate (measured_fp32_tflops), else none (DeviceSpec.tflops then gives fp32 the bf16 rate)."""
    fp32 = float(fp32_tflops)
    if tflops > 0:
        rate = fp32 or float(measured_fp32_tflops)
        if name == STANDIN:  # its rates, with the stand-in's ways (its dropout, no transients, no libraries)
            return replace(DEVICES[STANDIN], peak_tflops=float(tflops), pcie_gbps=float(link_gbps), fp32_tflops=rate)
        return DeviceSpec(name, float(tflops), int(memory_bytes), float(link_gbps), fp32_tflops=rate)
    try:
        listed = device_spec(name)
        return replace(listed, fp32_tflops=fp32) if fp32 > 0 else listed
    except ValueError as e:
        if measured_tflops > 0:
            rate = fp32 or float(measured_fp32_tflops)
            return DeviceSpec(name, float(measured_tflops), int(memory_bytes), float(link_gbps), fp32_tflops=rate)
        raise ValueError(
            f"{e}. For a GPU the table does not list, measure it (`mobiuspipe topology --probe --save "
            f"server.yaml` writes its bf16 and fp32 matmul rates into the layout) or write `tflops:` (its peak dense "
            f"fp16/bf16 TFLOPS, from the vendor's datasheet; `fp32_tflops:` its fp32 rate, for fp32 runs) under "
            f"the gpu in a layout file (`mobiuspipe topology "
            f"--save server.yaml` writes one to start from), and plan with it (--topology server.yaml, or "
            f"plan.topology)"
        ) from None


def topology_gpu_spec(topo: Topology, index: int = 0) -> DeviceSpec:
    """gpu_spec of gpu `index` of `topo`, with the matmul rate its probe measured, if any."""
    g, m = topo.gpus[index], topo.measured
    rates = m.matmul_tflops if m is not None else ()
    fp32 = m.matmul_fp32_tflops if m is not None else ()
    measured, measured_fp32 = (rates[index] if rates else 0.0), (fp32[index] if fp32 else 0.0)
    return gpu_spec(g.name, g.memory_bytes, g.link_gbps, g.tflops, measured, g.fp32_tflops, measured_fp32)


def device_spec(name: str) -> DeviceSpec:
    """The spec of device type `name`: exact NVML name, else case-insensitive without vendor prefixes."""
    if name in DEVICES:
        return DEVICES[name]
    found = _BY_SHORT.get(_short(name)) if isinstance(name, str) else None
    if found is None:
        raise ValueError(
            f"unknown device {name!r}; known devices: {', '.join(DEVICES)} "
            f'(the "NVIDIA "/"GeForce " prefixes and case may be omitted)'
        )
    return found
