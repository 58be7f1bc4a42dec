"""The plan's device-memory figure per gpu: the peak of the lifetime walk (partition.rules.lifetimes) over its step.

Legend (partition.rules.lifetimes has the walk's; units in brackets):
  W     plan.slot_bytes: one slot of the device arena = the largest stage's parameter bytes    [bytes]
  S     ARENA_SLOTS: slots in the arena (two weight slots, one gradient slot)                  [-]
  P_j   plan.stages[j].param_bytes                                                            [bytes]
  A_j   plan.stages[j].activation_bytes: live activations while stage j runs backward on one
        microbatch, its input and output buffers included                                     [bytes]
  I_j   stage j's input per microbatch: stage j-1's output_bytes; I_0 = plan.input_bytes        [bytes]
  Y     plan.target_bytes: one microbatch of the loss's targets                                [bytes]
  H_j   bytes (j, i) keeps on the device from its forward to its backward                     [bytes]
  X_g   plan.transients_on(g): what one of g's computing layers holds beyond A_j (its
        intermediates' gradients, a weight's gradient before it is added into the slot): the
        largest X_j of g's stages, measured on CUDA or counted by the analytic profile for a gpu [bytes]
  K     plan.workspace_bytes: what the plan holds apart on every gpu, the cuBLAS workspaces of
        the compute stream (the profile's library_bytes; and the largest X_l in plans made before
        stages recorded their X_j)                                                            [bytes]
  D_g   the walk's peak on gpu g: the arena, the held inputs, the messages queued in and out, and
        the computing stage's A_j; plus the regions g gives its peers' parked activations
        (partition.rules.peer: R(g, h), held the whole run) and the states of its stages on the gpu tier
        (partition.rules.placement.device_state_bytes: 16 T_j each, held the whole run); on a gpu plus
        X_g (make_plan holds each stage's to the memory rule, and the walk with it to G) and K (make_plan
        takes K off the memory every rule and walk is held to, so the walk's fit is D_g - K <= G); plus V_g,
        the layers' buffers g's stages keep the whole run (Plan.buffers_on; make_plan holds them apart
        likewise: plan.buffer_bytes >= V_g)                                                    [bytes]

Two runtime paths, each walked as it runs; on both H_j = I_j for a recompute stage on tier device (its input
stays on the device until B recomputes from it; activation_tier host, ssd or peer moves it off on the copy
streams, and the walk then counts it as swapped):
  a gpu (CUDA, NCCL; the default): the arena S * W whole (preallocated; the allocator's
      max_memory_allocated sees all of it), sends released once the schedules prove them taken;
  the CPU stand-in (standin=True), as its DeviceLedger counts: the arena's slots in use (P_j each), sends
      held to the step's end (gloo's send requests report completion only once waited on: Comm.flush; not
      so under MOBIUSPIPE_STRICT=1, whose sends complete once taken, as NCCL's do).
D_g >= S * W + max (A_j + X_j) of gpu g's stages (costmodel's memory rule S*W + A_j + X_j <= G) on a gpu: the rule
leaves out the queued messages and the held inputs. The runtime measures the real peak
(mobiuspipe.memory.measure) and the torchrun entry compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from partition.plan import Plan, StagePlan
from partition.rules.activations import ActivationPolicy
from partition.rules.lifetimes import StageBytes, device_peaks, device_timeline
from partition.rules.peer import context_bytes, regions
from partition.rules.placement import device_state_bytes
from partition.spec.analytic import DTYPE_BYTES

__all__ = ["gpu_headroom", "planned_device_bytes", "planned_timeline", "stage_bytes"]


def stage_bytes(plan: Plan, held: Sequence[int] | None = None, chosen: bool = False) -> list[StageBytes]:
    """The walk's bytes of each stage of the plan; held: H_j per stage (None: I_j, the input stays); chosen:
    held is the plan's activation choice, whose kept graphs may hold the stage's output."""
    last = plan.num_stages - 1
    out = []
    for j, s in enumerate(plan.stages):
        inp = plan.stages[j - 1].output_bytes if j > 0 else plan.input_bytes
        live = s.work_bytes if s.work_bytes >= 0 else s.activation_bytes
        work = live + (plan.input_bytes if j == 0 else 0) + (plan.target_bytes if j == last else 0)
        output = s.output_bytes if j < last else 0
        shared = output if chosen and _keeps_last_layer(s) else 0
        out.append(StageBytes(inp, output, work, inp if held is None else held[j], s.param_bytes, shared))
    return out


def _keeps_last_layer(s: StagePlan) -> bool:
    """Whether the stage's kept graphs end at its last layer (so they hold its output)."""
    return s.last in ActivationPolicy(s.activations, s.kept_layers).kept(s.first, s.last)


def planned_device_bytes(
    plan: Plan,
    standin: bool = False,
    held: Sequence[int] | None = None,
    sends_until_flush: bool | None = None,
    on_device: Sequence[int] = (),
) -> list[int]:
    """D_g of the legend for every gpu g of the plan, in gpu order, on a gpu or (standin) on the CPU
    stand-in; held: H_j per stage (another activation policy's), instead of the plan's (its activation
    choice's held_bytes; in plans before the choice, the path's own); sends_until_flush: whether sends are held
    to the step's end (default: on the stand-in; the strict stand-in's sends complete as NCCL's do); on_device: the
    stages whose states are on the gpu (memory.optimizer device), resident the whole run (device_state_bytes)."""
    walk = _Walked(plan, standin, held, sends_until_flush)
    peaks = device_peaks(plan.mapping, plan.num_microbatches, walk.stages, walk.arena, walk.until_flush, walk.swapped)
    peaks = peaks + [walk.arena or 0] * (plan.num_gpus - len(peaks))
    return [b + _whole_run_bytes(plan, g, standin, on_device) for g, b in enumerate(peaks)]


def gpu_headroom(plan: Plan, on_device: Sequence[int] | None = None) -> list[int]:
    """Per gpu, what the plan's usable memory (gpu_memory_bytes) leaves beside what the plan holds to it on a gpu: the
    walk with X_g, the states of the stages on_device (None: those the plan places on the gpu tier, StagePlan.
    optimizer_tier device) and the peers' contexts (partition.rules.peer's C), less K and V_g, which the usable
    memory is net of. Negative where that is over."""
    if on_device is None:
        on_device = [j for j, s in enumerate(plan.stages) if s.optimizer_tier == "device"]
    walk, contexts = planned_device_bytes(plan, on_device=on_device), context_bytes(plan)
    held = [walk[g] - plan.workspace_bytes - plan.buffers_on(g) + contexts[g] for g in range(plan.num_gpus)]
    return [plan.gpu_memory_bytes - h for h in held]


def planned_timeline(
    plan: Plan, gpu: int, standin: bool = False, sends_until_flush: bool | None = None, on_device: Sequence[int] = ()
) -> list[tuple[tuple, int]]:
    """(action, the planned bytes of `gpu` while it runs) for each of gpu's actions of one step, in order: the walk's
    timeline plus what the gpu holds the whole run, as planned_device_bytes counts it (whose figure is their most)."""
    walk = _Walked(plan, standin, None, sends_until_flush)
    timeline = device_timeline(
        plan.mapping, gpu, plan.num_microbatches, walk.stages, walk.arena, walk.until_flush, walk.swapped
    )
    extra = _whole_run_bytes(plan, gpu, standin, on_device)
    return [(step, b + extra) for step, b in timeline]


class _Walked:
    """What the walk of a plan takes on a gpu or the stand-in: each stage's bytes, the arena (held whole on a gpu),
    the stages that swap, whether sends are held to the step's end."""

    def __init__(self, plan: Plan, standin: bool, held: Sequence[int] | None, sends_until_flush: bool | None):
        chosen = [s.held_bytes for s in plan.stages]
        own = held is None and min(chosen) >= 0
        self.stages = stage_bytes(plan, chosen if own else held, chosen=own)
        self.swapped = frozenset(j for j, s in enumerate(plan.stages) if s.activation_tier not in ("auto", "device"))
        self.arena = None if standin else plan.arena_bytes
        self.until_flush = standin if sends_until_flush is None else sends_until_flush


def _whole_run_bytes(plan: Plan, gpu: int, standin: bool, on_device: Sequence[int]) -> int:
    """What gpu holds the whole run beside the walk: the regions it gives its peers' parked activations, the states
    of its stages on the gpu tier, on a gpu X_g and K (the stand-in's ledger counts no transients: its profiles
    measure none), and its stages' buffers V_g."""
    out = sum(nbytes for (owner, _), nbytes in regions(plan).items() if owner == gpu)
    dtype_bytes = DTYPE_BYTES[plan.dtype]
    out += sum(device_state_bytes(plan.stages[j].trains, dtype_bytes) for j in on_device if plan.stages[j].gpu == gpu)
    return out + (0 if standin else plan.workspace_bytes + plan.transients_on(gpu)) + plan.buffers_on(gpu)
