"""A profile refined by a traced run: each layer's times scaled by how its stage's F and B ran against the
simulator's, so that the planner predicts other plans of the same model from what a run on this machine measured.

A layer timed alone (mobiuspipe.profiling.profiler) is not the layer in a run: in a pipeline it shares the machine with
the other ranks' computations, its own process's copies, messages and host updates, and starts on weights just
loaded. A traced run (runtime.trace_steps) measures the layers where they run. For stage j of the plan as it
ran, over the traced steps:
  s_F(j) = median over steps of (sum of the step's measured F(j, i)) / (sum of the predicted F(j, i))
  s_B(j) = the same of B
(predicted: the simulator's events of that plan, from the profile being refined; the sums take every
microbatch, a visit's first included, so its extra cost is spread over the stage). Each layer l of stage j
gets F_l and K_l times s_F(j) (the forwards without and with grad), B_l and R_l times s_B(j); the last stage
is fused (its forward runs inside its B), so there s_B stands for s_F too. Identical layers (a transformer's
blocks, equal in name and bytes) in stages that ran differently get one scale, the mean of their stages'
weighted by the layers' predicted seconds: the run measured stages, not layers, and a plan made from the
refined profile should not move a cut between identical blocks for the noise of one run. Bytes and flops stay.
partition.sim.retime.retime then re-times another plan of the model from the refined profile.

The run also measures what posting a message to another rank costs the sender's thread (SA after an F, SG after
a B, where the neighbour stage is on another gpu): send_s, the median of those records, which the simulator
charges on a CPU stand-in's compute stream (topology Measured.message_send_s, SimStage.send_s), and what taking
one costs the receiver's thread: recv_s, the mean over the RA and RG records whose message came from another gpu
of  max(0, end(R) - max(start(R), end(its SA or SG) + comm_s))  (the receive's time from when both the receiver
reached the message and the simulator has it arrive, comm_s after its send: the latency and bytes that
partition.sim.stages charges, not counted twice; what is left is posting the receive and gloo's delivery beyond
the model, which on a busy machine waits for the sender's process to get a core; the mean, since these delays add
up along the step and a few are long), charged before the F or B that needs the message (Measured.message_recv_s,
SimStage.recv_s). On a GPU a receive's record, timed by events on the compute stream, ends once the bytes have
crossed: the transit is all it holds, so recv_s should come out near 0 there (not yet traced on a GPU).
And what the training loop spends between two steps' schedules:
step_overhead_s, the median over traced steps s whose next step is traced too of
  (start of rank 0's step s+1) - (start of its step s) - (the schedule's span in step s)
(the span from the first record of any rank to the last, host updates included; floored at 0): the collectives
of the loss and metrics, clipping, starting the updates and taking the next batch, which the simulator adds
to the step (Measured.step_overhead_s).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from mobiuspipe.runtime.action_trace import TracedAction, as_sim_result
from partition.plan import Plan
from partition.sim.stages import sim_stages
from partition.sim.types import SimResult
from partition.spec.profile import LayerProfile, Profile
from topology.types import Measured

__all__ = [
    "StageScale",
    "Refinement",
    "stage_scales",
    "refine_profile",
    "send_seconds",
    "recv_seconds",
    "loop_seconds",
    "median_profile",
]


@dataclass(frozen=True)
class StageScale:
    """Stage j's measured / predicted seconds of F (None on the fused last stage, whose F is empty) and of B."""

    stage: int
    forward: float | None
    backward: float


@dataclass(frozen=True)
class Refinement:
    """The refined profile, the scale of each stage it came from, send_s and recv_s (None: the run sent no
    message to another gpu) and step_overhead_s (None: no two consecutive steps were traced)."""

    profile: Profile
    scales: tuple[StageScale, ...]
    send_s: float | None = None
    recv_s: float | None = None
    step_overhead_s: float | None = None

    def measured_on(self, m: Measured | None) -> Measured:
        """A machine's measurements m with the costs this run measured (message_send_s, message_recv_s,
        step_overhead_s), each it did not measure kept as m had it."""
        got = {"message_send_s": self.send_s, "message_recv_s": self.recv_s, "step_overhead_s": self.step_overhead_s}
        return dataclasses.replace(m or Measured(), **{k: v for k, v in got.items() if v is not None})


def _sums(result: SimResult, kind: str) -> dict[int, float]:
    """Stage -> seconds of its `kind` events summed over microbatches."""
    out: dict[int, float] = {}
    for k, _gpu, stage, _mb, start, end in result.events:
        if k == kind:
            out[stage] = out.get(stage, 0.0) + end - start
    return out


def stage_scales(
    per_rank: list[list[TracedAction]], steps: list[int], plan: Plan, predicted: SimResult
) -> list[StageScale]:
    """s_F and s_B of every stage of `plan` (the legend); predicted: the simulator's step of that plan.

    Raises ValueError when no step is given or a stage has no traced or no predicted B."""
    if not steps:
        raise ValueError("refining a profile needs traced steps (runtime.trace_steps), found none")
    measured = [as_sim_result(per_rank, s) for s in steps]
    out = []
    last = plan.num_stages - 1
    for kind in ("F", "B"):
        want = _sums(predicted, kind)
        got = [_sums(m, kind) for m in measured]
        for j in range(plan.num_stages):
            if kind == "F" and j == last:
                continue
            if want.get(j, 0.0) <= 0 or any(j not in g for g in got):
                raise ValueError(
                    f"stage {j}'s {kind} is missing from the trace or the prediction: refine from a trace of the "
                    f"plan that was simulated (every stage traced in steps {steps})"
                )
            out.append((kind, j, statistics.median(g[j] for g in got) / want[j]))
    f = {j: r for kind, j, r in out if kind == "F"}
    return [StageScale(j, f.get(j), r) for kind, j, r in out if kind == "B"]


def refine_profile(
    profile: Profile, plan: Plan, per_rank: list[list[TracedAction]], steps: list[int], predicted: SimResult
) -> Refinement:
    """`profile` with each layer's times scaled by its stage's s_F and s_B, one scale per kind of layer (the
    legend): plan is the plan as the traced run ran it, made from `profile`, and predicted its simulated step."""
    if len(profile.layers) != plan.num_layers:
        raise ValueError(
            f"the profile has {len(profile.layers)} layers and the plan {plan.num_layers}: not its profile"
        )
    scales = stage_scales(per_rank, steps, plan, predicted)
    fwd, bwd = _kind_scales(profile, plan, scales)
    layers = [_scaled(x, fwd[_kind(x)], bwd[_kind(x)]) for x in profile.layers]
    return Refinement(
        dataclasses.replace(profile, layers=tuple(layers)),
        tuple(scales),
        send_seconds(per_rank, steps, plan),
        recv_seconds(per_rank, steps, plan),
        loop_seconds(per_rank, steps),
    )


NEIGHBOUR = {"SA": 1, "SG": -1, "RA": -1, "RG": 1}
"""The stage at a message's other end, from a send's or a receive's stage (SA: the next, RA: the previous, ...)."""
SENT_BY = {"RA": "SA", "RG": "SG"}
"""The traced kind that posted the message a receive takes."""


def _far(r: TracedAction, gpu: list[int]) -> bool:
    """Whether message record r (SA, SG, RA or RG) crossed to another gpu (a neighbour on its own is handed over)."""
    other = r.stage + NEIGHBOUR[r.kind]
    return 0 <= other < len(gpu) and gpu[other] != gpu[r.stage]


def _messages(per_rank: list[list[TracedAction]], steps: list[int], plan: Plan, kinds) -> list[TracedAction]:
    """The records of `kinds` in `steps` whose message crossed to another gpu."""
    want = set(steps)
    return [r for recs in per_rank for r in recs if r.kind in kinds and r.step in want and _far(r, plan.mapping)]


def send_seconds(per_rank: list[list[TracedAction]], steps: list[int], plan: Plan) -> float | None:
    """send_s of the legend: the median traced SA and SG of `steps` whose message went to another gpu."""
    far = [r.end_s - r.start_s for r in _messages(per_rank, steps, plan, ("SA", "SG"))]
    return statistics.median(far) if far else None


def recv_seconds(per_rank: list[list[TracedAction]], steps: list[int], plan: Plan) -> float | None:
    """recv_s of the legend: the mean over the traced RA and RG of `steps` whose message came from another gpu of
    their seconds from when both the receiver had reached the message and the simulator has it arrive (None: no
    such receive was traced with its send)."""
    transit = _transit(plan)
    posted = {(r.step, r.kind, r.stage, r.microbatch): r.end_s for r in _messages(per_rank, steps, plan, ("SA", "SG"))}
    took = []
    for r in _messages(per_rank, steps, plan, ("RA", "RG")):
        sender = r.stage + NEIGHBOUR[r.kind]
        sent = posted.get((r.step, SENT_BY[r.kind], sender, r.microbatch))
        if sent is not None:
            arrived = sent + transit[min(r.stage, sender)]  # an activation of the stage before, a gradient of r's own
            took.append(max(0.0, r.end_s - max(r.start_s, arrived)))
    return statistics.mean(took) if took else None


def _transit(plan: Plan) -> list[float]:
    """Seconds the simulator takes to deliver stage j's output (or the gradient of it) to the next stage's gpu:
    comm_s of partition.sim.stages (0 without a layout)."""
    if plan.layout is None:
        return [0.0] * plan.num_stages
    return [s.comm_s for s in sim_stages(plan.stages, plan.layout)]


def loop_seconds(per_rank: list[list[TracedAction]], steps: list[int]) -> float | None:
    """step_overhead_s of the legend (None: no step of `steps` has its next step traced on rank 0 too)."""
    starts = {r.step: r.start_s for r in per_rank[0] if r.kind == "step"} if per_rank else {}
    spans: dict[int, list[float]] = {}
    for r in (r for recs in per_rank for r in recs if r.kind != "step" and r.step in starts):
        first, last = spans.setdefault(r.step, [r.start_s, r.end_s])
        spans[r.step] = [min(first, r.start_s), max(last, r.end_s)]
    gaps = [
        max(0.0, starts[s + 1] - starts[s] - (spans[s][1] - spans[s][0]))
        for s in steps
        if s + 1 in starts and s in spans
    ]
    return statistics.median(gaps) if gaps else None


def _kind(layer: LayerProfile) -> tuple:
    """Identical layers (a transformer's blocks): one kind, one scale."""
    return (layer.name, layer.param_count, layer.param_bytes, layer.activation_bytes, layer.output_bytes)


def _kind_scales(profile: Profile, plan: Plan, scales: list[StageScale]) -> tuple[dict, dict]:
    """Per layer kind, the scales of the stages its layers sit in, weighted by those layers' predicted seconds
    (F: F_l, the fused last stage's R_l; B: B_l), so identical layers in stages that ran differently share one."""
    sums: dict[tuple, list[float]] = {}
    last = plan.num_stages - 1
    for j, (s, sc) in enumerate(zip(plan.stages, scales)):
        f = sc.backward if sc.forward is None else sc.forward
        for l in s.layers:
            x = profile.layers[l]
            wf, wb = (x.redo_s if j == last else x.fwd_s), x.bwd_s
            acc = sums.setdefault(_kind(x), [0.0, 0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2], acc[3] = acc[0] + f * wf, acc[1] + wf, acc[2] + sc.backward * wb, acc[3] + wb
    fwd = {k: (a[0] / a[1] if a[1] > 0 else 1.0) for k, a in sums.items()}
    bwd = {k: (a[2] / a[3] if a[3] > 0 else 1.0) for k, a in sums.items()}
    return fwd, bwd


def _scaled(layer: LayerProfile, fwd: float, bwd: float) -> LayerProfile:
    return dataclasses.replace(
        layer,
        fwd_s=layer.fwd_s * fwd,
        kept_s=layer.keep_s * fwd,
        bwd_s=layer.bwd_s * bwd,
        recompute_s=layer.redo_s * bwd,
    )


def median_profile(profiles: list[Profile]) -> Profile:
    """The first profile with each layer's four times the median over `profiles` (several refinements of one
    model, say from runs at different moments of a machine whose speed drifts). ValueError on none, or on
    profiles of different layer counts."""
    if not profiles or len({len(p.layers) for p in profiles}) != 1:
        raise ValueError(f"need profiles of one model, found layer counts {[len(p.layers) for p in profiles]}")

    def med(l: int, get) -> float:
        return statistics.median(get(p.layers[l]) for p in profiles)

    first = profiles[0]
    layers = tuple(
        dataclasses.replace(
            x,
            fwd_s=med(l, lambda y: y.fwd_s),
            kept_s=med(l, lambda y: y.keep_s),
            bwd_s=med(l, lambda y: y.bwd_s),
            recompute_s=med(l, lambda y: y.redo_s),
        )
        for l, x in enumerate(first.layers)
    )
    return dataclasses.replace(first, layers=layers)
