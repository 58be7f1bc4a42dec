"""The simulator's plain data: what it needs of each stage (SimStage), the drive (SsdLink), and what it
reports (SimResult); the legend of partition.sim.simulate applies."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SimStage", "SimResult", "SsdLink", "SSD_READ", "SSD_WRITE"]

SSD_READ = ("ssd", "read")
"""The drive's read link (partition.sim.flows.Link): loads of stages with their weights on the SSD and swap-ins
from the SSD tier cross it."""
SSD_WRITE = ("ssd", "write")
"""The drive's write link: offloads of stages with their gradients on the SSD and swap-outs to it cross it."""


@dataclass(frozen=True)
class SsdLink:
    """The SSD tier's drive (or array behind one folder): sequential read and write bandwidth, GB/s."""

    read_gbps: float
    write_gbps: float

    def seconds(self, read_bytes: int, write_bytes: int) -> float:
        """Drive time to read and write these bytes: reads and writes take turns, so their times add."""
        return read_bytes / (self.read_gbps * 1e9) + write_bytes / (self.write_gbps * 1e9)


@dataclass(frozen=True)
class SimStage:
    """What the simulator needs of stage j (per-microbatch times, bytes, its gpu)."""

    gpu: int
    fwd_s: float
    bwd_s: float
    load_s: float
    """Static load time, used when simulate() gets no topology."""
    offload_s: float
    """Static gradient offload time, used when simulate() gets no topology."""
    update_s: float
    comm_s: float
    """Time to move this stage's output (or the gradient of it) to the next stage's gpu."""
    param_bytes: int = 0
    """Bytes a load moves host->gpu (the weights in the loaded dtype); also the arena slot this stage needs."""
    grad_bytes: int = 0
    """Bytes an offload moves gpu->host (the stage's accumulated gradients)."""
    activation_bytes: int = 0
    """Live activation bytes while the stage runs backward on one microbatch."""
    output_bytes: int = 0
    """Bytes of the stage's output for one microbatch (sent to the next stage, its gradient sent back)."""
    ssd_read_bytes: int = 0
    """Bytes the stage's update reads from the SSD per step (its states, and gradients when on the ssd tier)."""
    ssd_write_bytes: int = 0
    """Bytes the stage's update writes to the SSD per step (its updated states, and weights when on the SSD)."""
    ssd_weights: bool = False
    """The weights and gradients are on the SSD: each load reads param_bytes from it, the offload writes
    grad_bytes to it (besides the update's ssd_read_bytes / ssd_write_bytes)."""
    offloads: bool = True
    """The gradients leave the gpu after the backward (False: its states are on the gpu tier, and so is its update:
    no offload moves, no host update)."""
    ssd_frozen: bool = False
    """The frozen weights (LoRA's base, most of param_bytes) are on the SSD: each load reads param_bytes from it."""

    @property
    def ssd_loads(self) -> bool:
        """Whether each load reads from the SSD (taken as all of param_bytes)."""
        return self.ssd_weights or self.ssd_frozen

    recompute_s: float | None = None
    """Seconds of the forward a B redoes before its backward (with grad); None: fwd_s."""
    fused: bool = False
    """The last stage as the runtime runs it: F takes no time, B runs forward, loss and backward."""
    swap_tier: str = "device"
    """Where the held activations live from F to B (partition.sim.swaps): host, ssd and peer move them."""
    held_bytes: int = 0
    """Bytes held per microbatch from F to B (what a swap moves each way)."""
    swap_out_s: float = 0.0
    """Static seconds of one swap-out, used when simulate() gets no topology."""
    swap_in_s: float = 0.0
    """Static seconds of one swap-in, used when simulate() gets no topology."""
    swap_peer: int = -1
    """The gpu whose memory holds the swapped bytes (swap_tier peer)."""
    send_s: float = 0.0
    """Seconds the gpu's compute stream spends posting each message this stage sends to another gpu (its
    output after F, its input gradient after B): CPU stand-ins, whose ranks send from the computing thread."""
    recv_s: float = 0.0
    """Seconds the gpu's compute stream spends on each message this stage receives from another gpu, from when
    both the message has arrived and the stream reached it (its input before F, its output gradient before B):
    CPU stand-ins, whose ranks receive on the computing thread and whose messages move only when the sender's
    process gets a core (mobiuspipe.profiling.refine measures it under the run's load)."""

    @property
    def f_s(self) -> float:
        """Seconds of one F of this stage."""
        return 0.0 if self.fused else self.fwd_s

    @property
    def b_s(self) -> float:
        """Seconds of one B of this stage: the recomputed forward, then the backward."""
        return (self.fwd_s if self.recompute_s is None else self.recompute_s) + self.bwd_s


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    compute_busy_s: tuple[float, ...]
    """Per gpu: seconds its compute stream is busy."""
    events: tuple[tuple[str, int, int, int, float, float], ...]
    """(kind, gpu, stage, microbatch or -1, start, end) for kind in load/F/B/offload/update."""
    link_bytes: tuple[tuple[str, str, int], ...] = ()
    """(link, direction, bytes moved in the step), in topology order; gpu links only without a topology."""
    peak_arena_bytes: tuple[int, ...] = ()
    """Per gpu: most arena bytes in use at once (weight slots in use x W + gradient slots in use x W_grad)."""
    activation_bytes: tuple[int, ...] = ()
    """Per gpu: the largest live activation bytes of its stages."""
    stage_bytes: tuple[tuple[int, int], ...] = ()
    """Per stage: (param_bytes, grad_bytes), so a picture can show a transfer's average rate."""
    link_model: str = "static"
    """"static" (fixed load_s/offload_s) or "flows:<topology name>" (shared links)."""

    @property
    def busy_fraction(self) -> tuple[float, ...]:
        """Per gpu: compute busy seconds / step time."""
        return tuple(b / self.step_time_s if self.step_time_s > 0 else 0.0 for b in self.compute_busy_s)

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        """Per gpu: peak arena bytes + largest activation bytes."""
        return tuple(a + b for a, b in zip(self.peak_arena_bytes, self.activation_bytes))

    def to_dict(self) -> dict:
        """Plain data for --json (no events: see partition.report.trace.chrome_trace for those)."""
        return {
            "step_time_s": self.step_time_s,
            "link_model": self.link_model,
            "compute_busy_s": list(self.compute_busy_s),
            "busy_fraction": list(self.busy_fraction),
            "peak_arena_bytes": list(self.peak_arena_bytes),
            "activation_bytes": list(self.activation_bytes),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "link_bytes": [{"link": n, "direction": d, "bytes": b} for n, d, b in self.link_bytes],
        }
