"""The simulator's view of a plan (partition.sim.simulate's SimStage per stage) on a topology: static times,
bytes, the host's Adam rate and cores, and each stage's swaps."""

from __future__ import annotations

from partition.plan import StagePlan
from partition.rules.mapping import peer_gbps
from partition.rules.memory_plan import MemoryPlan
from partition.rules.peer import peer_gpu
from partition.rules.tiers import ssd_info
from partition.sim.swaps import SWAP_TIERS
from partition.sim.types import SimStage
from topology import Topology

__all__ = ["HOST_ADAM_PARAMS_PER_S", "host_adam_rate", "host_cores", "loop_overhead", "sim_stages"]

HOST_ADAM_PARAMS_PER_S = 1.0e9
"""Parameters per second each rank's host Adam updates (its share of the cores, every rank updating at once) when the
topology has no measurement (`topology --probe` measures it): torch AdamW ran ~0.9-1e9/s on one core of this
project's 2-core machine; a server's rank has several cores and its share of the memory bandwidth."""


def host_adam_rate(topo: Topology) -> float:
    """The topology's measured host Adam rate of one rank, else HOST_ADAM_PARAMS_PER_S."""
    m = topo.measured
    return m.host_adam_params_per_s if m and m.host_adam_params_per_s > 0 else HOST_ADAM_PARAMS_PER_S


def host_cores(topo: Topology) -> float | None:
    """The cores the computations of CPU stand-ins share (topology --probe measures them), else None: each
    gpu computes on its own."""
    m = topo.measured
    return m.host_cores if m and m.host_cores > 0 else None


def loop_overhead(topo: Topology) -> float:
    """The training loop's seconds per step outside the schedule that a traced run measured on this machine
    (Measured.step_overhead_s), else 0."""
    return topo.measured.step_overhead_s if topo.measured else 0.0


def sim_stages(stages: tuple[StagePlan, ...], topo: Topology, memory: MemoryPlan | None = None) -> list[SimStage]:
    """The simulator's view of a plan's stages on a topology.

    Static times (for simulate() without a topology): a load at the stage's planned load_gbps, an offload
    at the gpu's own link speed. An activation to another gpu (and its gradient back) takes output_bytes at
    the pair's bandwidth, or, when the topology measured its messages (CPU stand-ins: gloo between ranks),
    their latency + output_bytes at their GB/s. Bytes (for simulate(..., topology=topo)): a load moves param_bytes, an
    offload the gradients (grad_bytes: param_bytes, or under LoRA the adapters' alone), and the update is over
    the trainable parameters. With `memory` (the
    plan's tiers), each stage's SSD traffic per step: its update's (streamed under the update), and with its
    weights on the SSD, its loads' reads and its offload's write (simulate(..., ssd=...)); a stage whose states are
    on the gpu tier offloads nothing and has no host update.
    """
    out = []
    m = topo.measured
    latency, msg_gbps = (m.message_latency_s, m.message_gbps) if m and m.message_latency_s > 0 else (0.0, 0.0)
    for j, s in enumerate(stages):
        nxt = stages[j + 1].gpu if j + 1 < len(stages) else s.gpu
        gbps = msg_gbps if msg_gbps > 0 else peer_gbps(topo, s.gpu, nxt)
        comm = 0.0 if nxt == s.gpu else latency + s.output_bytes / (gbps * 1e9)
        offloads = memory is None or memory.stages[j].optimizer != "device"
        out.append(
            SimStage(
                gpu=s.gpu,
                fwd_s=s.f_s,
                bwd_s=s.bwd_s,
                recompute_s=s.fwd_s if s.recompute_s is None else s.recompute_s,
                fused=j == len(stages) - 1,
                load_s=s.load_s,
                offload_s=s.gradient_bytes / (topo.gpus[s.gpu].link_gbps * 1e9) if offloads else 0.0,
                update_s=s.trains / host_adam_rate(topo) if offloads else 0.0,
                offloads=offloads,
                comm_s=comm,
                send_s=m.message_send_s if m else 0.0,
                recv_s=m.message_recv_s if m else 0.0,
                param_bytes=s.param_bytes,
                grad_bytes=s.gradient_bytes,
                activation_bytes=s.activation_bytes,
                output_bytes=s.output_bytes,
                ssd_read_bytes=memory.stages[j].update_read_bytes if memory else 0,
                ssd_write_bytes=memory.stages[j].update_write_bytes if memory else 0,
                ssd_weights=memory is not None and memory.stages[j].weights == "ssd",
                ssd_frozen=memory is not None and memory.stages[j].frozen == "ssd",
                **_swap_fields(s, j == len(stages) - 1, topo),
            )
        )
    return out


def _swap_fields(s: StagePlan, last: bool, topo: Topology) -> dict:
    """A stage's swaps for the simulator (partition.sim.swaps): its tier, held bytes and static times (each
    way: H over the gpu's link; the SSD tier at the least of it and the drive's GB/s, unprobed: one NVMe's;
    the peer tier staged through host, its copies in turn on the one copy stream, on partition.rules.peer's gpu)."""
    if last or s.activation_tier not in SWAP_TIERS or s.held_bytes <= 0:
        return {}
    link = topo.gpus[s.gpu].link_gbps * 1e9
    out = back = s.held_bytes / link
    peer = peer_gpu(s.gpu, topo.num_gpus)
    if s.activation_tier == "ssd":
        drive = ssd_info(topo).link
        out, back = s.held_bytes / min(link, drive.write_gbps * 1e9), s.held_bytes / min(link, drive.read_gbps * 1e9)
    elif s.activation_tier == "peer":
        out = back = s.held_bytes / link + s.held_bytes / (topo.gpus[peer].link_gbps * 1e9)
    return {
        "swap_tier": s.activation_tier,
        "held_bytes": s.held_bytes,
        "swap_out_s": out,
        "swap_in_s": back,
        "swap_peer": peer,
    }
