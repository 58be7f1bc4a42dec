"""What a user would run instead of mobiuspipe on the same server, predicted with the same link model.

Every baseline trains on the same step as the plan: M microbatches of the profile's microbatch size, the
same layers, times and bytes (partition.spec.profile), the same links (partition.sim.simulate: flows share the
PCIe links and uplinks on their path) and the same host Adam rate per rank (search.host_adam_rate: measured, or
HOST_ADAM_PARAMS_PER_S; each gpu's process updates its own share, the processes at once).

gpipe            GPipe / torchgpipe: N contiguous stages, one per gpu, everything resident. Memory per gpu
                 = 16 bytes/param (fp16 weights 2 + fp16 gradients 2 + fp32 master 4 + Adam m, v 8;
                 ZeRO-Offload's mixed-precision count) + the stashed input of every microbatch in flight
                 (M x O_{a-1}) + one microbatch's live activations A_j (checkpointing, as torchgpipe does by
                 default; the plan recomputes too, so compute is alike). Cuts: the least largest-stage compute
                 among cuts that fit, else OOM with the numbers of the leanest cut. Step: the simulator with
                 N stages on N gpus and nothing to load (F of all microbatches, then B; activations over the
                 same peer links). The optimizer step on the gpu is taken as free (favours GPipe).
zero_offload     DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU (ZeRO-Offload / ZeRO-Infinity
                 style), data parallel over the N gpus. Each gpu runs the whole model on k = ceil(M/N)
                 microbatches at once (one micro-step, no gradient accumulation: fewest parameter fetches).
                 Per layer l and pass (forward; again in the backward, except the last layer, still resident):
                 every gpu receives all P_l fp16 parameter bytes host->gpu (its partition plus the all-gather
                 of the others' through host memory: no P2P) and sends (N-1)/N P_l gpu->host (the ring's
                 forwarding). After the backward of layer l, its fp16 gradients are reduce-scattered through
                 host memory and the gpu's partition offloaded: (N-1)/N P_l host->gpu and P_l gpu->host per
                 gpu. A collective ends when every gpu's flows ended (all gpus wait for it). Parameters are
                 prefetched one layer ahead (two buffers); reduce-scatters run behind the backward, one at a
                 time. Compute per layer: k*F_l forward, k*(F_l+B_l) backward (checkpointing: recompute), the
                 same on every gpu. Each rank's CPU Adam over its 1/N partition of the parameters runs after the
                 last gradient arrived, the ranks at once (DeepSpeed's step() follows backward(); ZeRO-3 has no
                 delayed update). Memory per gpu: two
                 layers of parameters + one of gradients + k x every layer's input (checkpoints) + k x one
                 layer's live activations. Not modelled (all would slow DeepSpeed down): per-collective
                 latency, small buckets, the fp32<->fp16 conversions and the host-side gradient reduction.
sequential       mobiuspipe's own planner with round-robin instead of cross mapping (make_plan).

Under LoRA (a profile whose layers train only their adapters, T_l < N_l): GPipe keeps 16 bytes per trainable
parameter and the frozen ones in their loaded dtype (P_l - G_l bytes); ZeRO-3 offload + LoRA (DeepSpeed with
PEFT, the frozen base partitioned and offloaded as ZeRO-3 does every parameter) gathers P_l as before, but
reduce-scatters and offloads only the adapters' gradients G_l, and its CPU Adam runs over the adapters alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from foundation.units import GiB
from partition.errors import PlanInfeasibleError
from partition.plan import Plan
from partition.rules.costmodel import LayerArrays
from partition.search import host_adam_rate, make_plan, sim_stages, stage_plan
from partition.sim.flows import FlowNet, TaskGraph
from partition.sim.simulate import SimResult, link_paths, simulate
from partition.spec.profile import Profile
from topology import Topology

__all__ = [
    "BaselineResult",
    "MIXED_PRECISION_BYTES_PER_PARAM",
    "predict",
    "gpipe",
    "zero_offload",
    "sequential_mapping",
]

MIXED_PRECISION_BYTES_PER_PARAM = 16
"""fp16 weights and gradients (2 + 2) + fp32 master weights, Adam momentum and variance (4 + 4 + 4)."""


@dataclass(frozen=True)
class BaselineResult:
    """One system's predicted step: step_time_s, or None and the reason (e.g. out of memory)."""

    name: str
    step_time_s: float | None
    reason: str = ""
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"notes": list(self.notes)}


def predict(plan: Plan, topo: Topology, delayed: bool = False) -> SimResult:
    """The plan's step on the topology with shared links (what `mobiuspipe simulate` reports); delayed: with the
    delayed update."""
    return simulate(sim_stages(plan.stages, topo), topo.num_gpus, plan.num_microbatches, topology=topo, delayed=delayed)


def sequential_mapping(
    profile: Profile, topo: Topology, microbatches: int, delayed: bool = False, **plan_options
) -> BaselineResult:
    """mobiuspipe with round-robin stage->gpu mapping (make_plan(..., mapping="round-robin", **plan_options)); delayed:
    with the delayed update."""
    name = "mobiuspipe, sequential mapping"
    try:
        plan = make_plan(profile, topo, microbatches, mapping="round-robin", **plan_options)
    except PlanInfeasibleError as e:
        return BaselineResult(name, None, f"no plan: {e}")
    sim = predict(plan, topo, delayed)
    return BaselineResult(
        name,
        sim.step_time_s,
        notes=(
            f"{plan.num_stages} stages, mapping {plan.mapping[: 2 * topo.num_gpus]}...",
            f"compute busy {min(sim.busy_fraction):.0%}-{max(sim.busy_fraction):.0%} of the step",
        ),
    )


# ---- GPipe ----


def _minmax_cut(num_layers: int, parts: int, cost) -> tuple[float, list[tuple[int, int]]]:
    """Cut layers 0..L-1 into `parts` contiguous non-empty ranges minimizing the largest cost(a, b)."""
    L = num_layers
    f = [[math.inf] * (L + 1) for _ in range(parts + 1)]
    arg = [[0] * (L + 1) for _ in range(parts + 1)]
    f[0][0] = 0.0
    for s in range(1, parts + 1):
        for l in range(s, L + 1):
            for k in range(s - 1, l):
                v = max(f[s - 1][k], cost(k, l - 1))
                if v < f[s][l]:
                    f[s][l], arg[s][l] = v, k
    cuts = [L]
    for s in range(parts, 0, -1):
        cuts.append(arg[s][cuts[-1]])
    cuts.reverse()
    return f[parts][L], [(a, b - 1) for a, b in zip(cuts, cuts[1:])]


def gpipe_stage_bytes(arr: LayerArrays, a: int, b: int, microbatches: int) -> int:
    """GPU memory of a GPipe stage of layers a..b (see the module docstring)."""
    stash = microbatches * (int(arr.O[a - 1]) if a > 0 else 0)
    frozen = arr.params(a, b) - arr.grads(a, b)
    return MIXED_PRECISION_BYTES_PER_PARAM * arr.trainable(a, b) + frozen + stash + arr.activations(a, b)


def gpipe(profile: Profile, topo: Topology, microbatches: int, reserve_bytes: int = 0) -> BaselineResult:
    """GPipe with everything in gpu memory: its step, or OOM with the numbers (see the module docstring)."""
    name, arr, n = "GPipe (all in gpu memory)", LayerArrays.of(profile), topo.num_gpus
    memory = min(g.memory_bytes for g in topo.gpus) - reserve_bytes
    if arr.num_layers < n:
        return BaselineResult(name, None, f"{arr.num_layers} layers cannot fill {n} gpus")
    mem = lambda a, b: gpipe_stage_bytes(arr, a, b, microbatches)  # noqa: E731
    least, lean = _minmax_cut(arr.num_layers, n, mem)
    if least > memory:
        total = gpipe_stage_bytes(arr, 0, arr.num_layers - 1, 0) - arr.activations(0, arr.num_layers - 1)
        return BaselineResult(
            name,
            None,
            (
                f"out of memory: the leanest cut into {n} stages needs {least / GiB:.1f} GiB on its fullest gpu, "
                f"a gpu has {memory / GiB:.1f} GiB usable ({MIXED_PRECISION_BYTES_PER_PARAM} B/"
                f"{'trained param, the frozen in their dtype' if _lora(arr) else 'param'}: "
                f"{total / GiB:.0f} GiB of model states in all)"
            ),
            (f"leanest cut: layers {lean}",),
        )
    work = lambda a, b: (2 * arr.fwd(a, b) + arr.bwd(a, b)) if mem(a, b) <= memory else math.inf  # noqa: E731
    _, ranges = _minmax_cut(arr.num_layers, n, work)
    stages = tuple(stage_plan(arr, a, b, j, 1.0) for j, (a, b) in enumerate(ranges))
    resident = [
        dataclasses.replace(s, load_s=0.0, offload_s=0.0, update_s=0.0, param_bytes=0, grad_bytes=0, fused=False)
        for s in sim_stages(stages, topo)  # GPipe runs its last stage's forward apart (no fusing)
    ]
    sim = simulate(resident, n, microbatches)
    fullest = max(mem(a, b) for a, b in ranges)
    return BaselineResult(
        name,
        sim.step_time_s,
        notes=(
            f"stages {ranges}, fullest gpu {fullest / GiB:.1f} of {memory / GiB:.1f} GiB",
            "optimizer step on the gpu taken as free",
        ),
    )


# ---- ZeRO-3 offload ----


def _lora(arr: LayerArrays) -> bool:
    """Whether the profile trains only some parameters (LoRA's adapters)."""
    return arr.trainable(0, arr.num_layers - 1) < arr.param_count(0, arr.num_layers - 1)


def zero_gpu_bytes(arr: LayerArrays, k: int) -> int:
    """GPU memory of ZeRO-3 offload running k microbatches at once (see the module docstring)."""
    layers = range(arr.num_layers)
    return (
        2 * max(arr.params(l, l) for l in layers)
        + max(arr.grads(l, l) for l in layers)
        + k * int(arr.O.sum())
        + k * max(arr.activations(l, l) for l in layers)
    )


def _collective(nbytes: int, n: int, paths: dict, up: str, down: str) -> list:
    """Per gpu: nbytes one way (`up`), (n-1)/n of them the other way (`down`)."""
    rest = nbytes * (n - 1) / n
    return [f for g in range(n) for f in ((nbytes, paths[(g, up)]), (rest, paths[(g, down)]))]


def _zero_graph(arr: LayerArrays, topo: Topology, k: int, passes: int) -> TaskGraph:
    """Gathers, compute and reduce-scatters of `passes` micro-steps of k microbatches, then the CPU Adam."""
    caps, paths = link_paths(topo)
    graph, n, last = TaskGraph(FlowNet(caps)), topo.num_gpus, arr.num_layers - 1
    gather = compute = reduce = None
    users: list = []  # per gather, the last computation that reads its buffer
    order = [("F", l) for l in range(last + 1)] + [("B", l) for l in range(last, -1, -1)]
    for p, (phase, l) in [(p, v) for p in range(passes) for v in order]:
        fresh = not (phase == "B" and l == last)  # the last layer's parameters are still there
        if fresh:
            flows = _collective(arr.params(l, l), n, paths, "h2d", "d2h")
            gather = graph.add(("gather", p, phase, l), (gather, users[-2] if len(users) > 1 else None), flows=flows)
        dur = k * arr.fwd(l, l) if phase == "F" else k * (arr.fwd(l, l) + arr.bwd(l, l))
        compute = graph.add(("compute", p, phase, l), (compute, gather), dur)
        users.append(compute) if fresh else users.__setitem__(-1, compute)
        if phase == "B" and arr.grads(l, l) > 0:  # under LoRA a layer without adapters has no gradient
            flows = _collective(arr.grads(l, l), n, paths, "d2h", "h2d")
            reduce = graph.add(("reduce", p, l), (compute, reduce), flows=flows)
    graph.add(("adam",), (compute, reduce), arr.trainable(0, last) / n / host_adam_rate(topo))  # a partition a rank
    return graph


def zero_offload(profile: Profile, topo: Topology, microbatches: int, reserve_bytes: int = 0) -> BaselineResult:
    """DeepSpeed ZeRO-3 with parameters and optimizer on the CPU: its step, or OOM (see the module docstring)."""
    arr, n = LayerArrays.of(profile), topo.num_gpus
    name = "DeepSpeed ZeRO-3 offload" + (" + LoRA" if _lora(arr) else "")
    memory = min(g.memory_bytes for g in topo.gpus) - reserve_bytes
    per_gpu = math.ceil(microbatches / n)
    fits = [a for a in range(1, per_gpu + 1) if zero_gpu_bytes(arr, math.ceil(per_gpu / a)) <= memory]
    if not fits:
        need = zero_gpu_bytes(arr, 1)
        return BaselineResult(
            name,
            None,
            f"out of memory: {need / GiB:.1f} GiB per gpu for one microbatch (3 layers "
            f"of parameters and gradients + every layer's checkpoint + one layer's "
            f"activations), a gpu has {memory / GiB:.1f} GiB usable",
        )
    passes = fits[0]
    k = math.ceil(per_gpu / passes)
    tasks = _zero_graph(arr, topo, k, passes).run()
    last, adam = arr.num_layers - 1, tasks[("adam",)]
    fwd, bwd = tasks[("compute", 0, "F", last)].end, tasks[("compute", passes - 1, "B", 0)].end
    busy = sum(t.end - t.start for key, t in tasks.items() if isinstance(key, tuple) and key[0] == "compute")
    samples = n * passes * k
    notes = (
        f"{n} gpus x {passes} micro-step(s) of {k} microbatch(es)"
        + (f" = {samples} microbatches, more than the plan's {microbatches}" if samples != microbatches else ""),
        f"first forward ends {fwd:.2f} s, last backward {bwd:.2f} s, last gradients on host "
        f"{max(t.end for key, t in tasks.items() if isinstance(key, tuple) and key[0] == 'reduce'):.2f} s, then "
        f"CPU Adam "
        f"{adam.end - adam.start:.2f} s",
        f"compute busy {busy / adam.end:.0%} of the step; {zero_gpu_bytes(arr, k) / GiB:.1f} of "
        f"{memory / GiB:.1f} GiB per gpu",
    )
    return BaselineResult(name, adam.end, notes=notes)
