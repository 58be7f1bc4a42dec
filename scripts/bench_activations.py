"""The largest microbatch (and sequence length) that trains under a fixed device budget, per activation policy
(issue 13): recompute only, keep everything, and the planner's choice; the plan's walk against the measured
device peak there, and every policy's step time by size. One rank, a CPU stand-in of --budget-mb, the built-in
GPT cut into --stages stages by the exact DP, planned from a measured profile (--profile analytic: the one a
config run plans from).

Policies (the same model, microbatch count and budget):
  recompute  make_plan(activations="recompute"), run with memory.activations: recompute
  keep       that plan with every stage recorded as keep (with_activations(modes={"device": ("keep",)})),
             run with memory.activations: keep; nothing else plans keep, so its walk must fit the budget
  chosen     make_plan(activations="auto") (the default), run with memory.activations: plan (the default)
  offload    the same with host memory to spare (a host budget of HOST_GIB GiB: the choice may hold activations
             on the host tier), run with memory.activation_tier: plan (the default): held bytes swap to the
             host between F and B
A size trains when the planner accepts it (make_plan raises no PlanInfeasibleError; keep: and its walk is
within the budget) and the measured peak of its steps (StepResult.device_peak_bytes, the ledger) is within the
budget: the ledger counts bytes but refuses none, so the budget is checked after the steps. The search plans
only, for the largest size the planner accepts and within it the largest whose walk fits, then runs there and
up or down until the measured peak decides. The timing table runs the policies' Pipelines side by side,
stepped in turn, so that the machine's drift touches them alike (at least --steps steps, more until
--min-seconds). Random tokens: the peak and the time do not depend on the text.

  .venv/bin/python scripts/bench_activations.py            # microbatch, then sequence length (about 9 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from bench_pipeline import machine
from benchlib import cpu_mark, markdown_table, other_share

from foundation.timing import Stopwatch
from mobiuspipe import Pipeline
from mobiuspipe.config import RunConfig, config_from_dict
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.profiling.profiler import measure_profile
from mobiuspipe.startup.config_plan import gpt_profile, model_spec, run_topology
from partition import make_plan
from partition.errors import PlanInfeasibleError
from partition.plan import Plan
from partition.rules.activation_choice import with_activations
from partition.rules.device_peak import planned_device_bytes
from partition.rules.tiers import HostBudget
from partition.spec.profile import Profile

MiB = 1 << 20
POLICIES = ("recompute", "keep", "chosen", "offload")
RUNTIME = {"recompute": "recompute", "keep": "keep", "chosen": "plan", "offload": "plan"}
"""The runtime's memory.activations for each policy."""
HOST_GIB = 16
"""The offload policy's host budget (GiB): far more than these runs hold."""


@dataclass(frozen=True)
class Verdict:
    """One size of one policy: its plan (None: the memory rule refused it), its walk, and why the planner
    refuses it ("" when it accepts)."""

    plan: Plan | None
    walk: int
    refused: str = ""


@dataclass(frozen=True)
class Largest:
    """A policy's largest size that trains, its figures there, why the next size does not, and the largest
    size the planner accepts."""

    size: int
    walk: int
    measured: int
    next_fails: str
    modes: str
    accepted: int


def config(args: argparse.Namespace, axis: str, value: int) -> RunConfig:
    """The run config at `value` of the searched axis ("microbatch": sequences per microbatch; "seq": tokens
    per sequence), the other axis at its fixed value."""
    mb, seq = (value, args.seq_len) if axis == "microbatch" else (args.microbatch, value)
    return config_from_dict(
        {
            "model": {"num_blocks": args.blocks, "d_model": args.d_model, "num_heads": args.heads, "seq_len": seq},
            "data": {"batch_size": mb * args.microbatches, "num_microbatches": args.microbatches},
            "train": {"precision": "fp32", "seed": 1},
            "plan": {"num_gpus": 1, "num_stages": args.stages, "device_memory_mb": args.budget_mb},
        }
    )


PROFILES: dict[tuple[str, int, int], Profile] = {}
"""The profile of each (kind, batch_size, seq_len), made once: every policy at a size plans from the same one."""


def profile_of(cfg: RunConfig, kind: str) -> Profile:
    """cfg's profile: "analytic" (what a config run plans from: mobiuspipe.startup.config_plan.gpt_profile) or
    "measured" (what Pipeline(sample=...) plans from: every layer timed and its saved bytes counted on one
    microbatch)."""
    key = (kind, cfg.data.batch_size, cfg.model.seq_len)
    if key not in PROFILES:
        PROFILES[key] = gpt_profile(cfg) if kind == "analytic" else _measured(cfg)
    return PROFILES[key]


def _measured(cfg: RunConfig) -> Profile:
    x, y = batch(cfg, 0)
    mb, m = cfg.microbatch_size, cfg.data.num_microbatches
    assert mb is not None and m is not None, "the benchmark's configs fix data.num_microbatches"
    layers = [make() for make in layer_factories(model_spec(cfg), cfg.train.seed)]
    profile = measure_profile(
        layers,
        x[:mb],
        device="cpu",
        name=model_spec(cfg).name,
        device_name="cpu-standin",
        dtype_name="fp32",
        microbatch_size=mb,
        seq_len=cfg.model.seq_len,
        loss_fn=lambda out: lm_loss(out, y[:mb]),
        microbatches=m,
    )
    return dataclasses.replace(profile, target_bytes=y[:mb].numel() * y.element_size())


def plan_for(policy: str, cfg: RunConfig, kind: str) -> Plan:
    """The policy's plan for cfg on its CPU stand-in from a `kind` profile; PlanInfeasibleError when the memory
    rule refuses it."""
    profile, topo = profile_of(cfg, kind), run_topology(cfg)
    auto = policy in ("chosen", "offload")
    kw: dict = {"num_stages": cfg.plan.num_stages, "solver": "dp", "activations": "auto" if auto else "recompute"}
    if policy == "offload":
        kw["host_budget"] = HostBudget(HOST_GIB << 30, "the benchmark's")
    m = cfg.data.num_microbatches
    assert m is not None, "the benchmark's configs fix data.num_microbatches"
    plan = make_plan(profile, topo, m, **kw)
    if policy == "keep":
        plan, _ = with_activations(plan, profile, topo, 1 << 62, modes={"device": ("keep",)})
    return plan


def verdict(policy: str, cfg: RunConfig, budget: int, kind: str) -> Verdict:
    """Whether the planner accepts the policy at cfg's size, planning from a `kind` profile."""
    try:
        plan = plan_for(policy, cfg, kind)
    except PlanInfeasibleError as e:
        return Verdict(None, 0, f"planner: {str(e).split(':')[0]}")
    walk = max(planned_device_bytes(plan, standin=True))
    over = policy == "keep" and walk > budget
    return Verdict(plan, walk, f"keep's walk {walk / MiB:.1f} MiB > budget" if over else "")


def batch(cfg: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random tokens (seeded by step) and its next-token targets."""
    g = torch.Generator().manual_seed(step)
    t = torch.randint(cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def pipeline(policy: str, cfg: RunConfig, plan: Plan) -> Pipeline:
    layers = layer_factories(model_spec(cfg), cfg.train.seed)
    return Pipeline(layers, lm_loss, plan=plan, optimizer=partial(CPUAdam, lr=1e-4), activations=RUNTIME[policy])


def step(p: Pipeline, cfg: RunConfig, s: int) -> tuple[float, int]:
    """(seconds, measured device peak) of one step, its host updates included (the next step needs them)."""
    with Stopwatch() as sw:
        r = p.train_batch(*batch(cfg, s))
        p.engine.wait_updates()
    return sw.s, r.device_peak_bytes


def run(runs: dict[str, tuple[RunConfig, Plan]], steps: int, min_s: float = 0.0) -> dict[str, tuple[float, int]]:
    """Each {name: (cfg, plan)} a Pipeline, all alive at once and stepped in turn; per name the median step
    seconds after one untimed step, and the largest measured peak of every step. At least `steps` timed steps,
    more (up to 6 x steps) until each name's timed steps add up to min_s: short steps are the noisiest."""
    pipes = {name: pipeline(name, cfg, plan) for name, (cfg, plan) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    peaks = dict.fromkeys(runs, 0)
    try:
        s = 0
        while s <= steps or (s <= 6 * steps and min(sum(t) for t in times.values()) < min_s):
            for name, p in pipes.items():
                t, peak = step(p, runs[name][0], s)
                times[name] += [t] if s else []
                peaks[name] = max(peaks[name], peak)
            s += 1
    finally:
        for p in pipes.values():
            p.close()
    return {name: (statistics.median(times[name]), peaks[name]) for name in runs}


def modes(plan: Plan) -> str:
    """The plan's stage modes by initial: r(ecompute), s(elective), k(eep) (the last stage's fused forward is k),
    with "@h" / "@s" for held bytes on the host / SSD tier."""
    tier = {"host": "@h", "ssd": "@s"}
    return "/".join(s.activations[0] + tier.get(s.activation_tier, "") for s in plan.stages)


def accepted_limit(ok: Callable[[int], bool], top: int) -> int:
    """The largest k in 1..top with ok(k) (ok true up to a point, then false); 0 when ok(1) is false."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= top and ok(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def largest(policy: str, args: argparse.Namespace, axis: str, unit: int, top: int) -> Largest | None:
    """The policy's largest size (a multiple of unit up to top) that trains, or None when not even unit does.
    Planning only: the largest size k the planner accepts, and within it the largest whose walk fits the
    budget; then one run there and runs up (while the measured peak fits) or down (until it does)."""
    budget = int(args.budget_mb * MiB)
    verdicts: dict[int, Verdict] = {}
    peaks: dict[int, int] = {}

    def at(k: int) -> Verdict:
        if k not in verdicts:
            verdicts[k] = verdict(policy, config(args, axis, k * unit), budget, args.profile)
        return verdicts[k]

    def measured(k: int) -> int:
        if k not in peaks:
            plan = at(k).plan
            assert plan is not None
            peaks[k] = run({policy: (config(args, axis, k * unit), plan)}, 1)[policy][1]
            print(f"  {policy} {axis} {k * unit}: walk {at(k).walk / MiB:.2f} MiB, measured {peaks[k] / MiB:.2f} MiB")
        return peaks[k]

    accepted = accepted_limit(lambda k: not at(k).refused, top // unit)
    k = max(1, accepted_limit(lambda k: not at(k).refused and at(k).walk <= budget, accepted)) if accepted else 0
    if k and measured(k) <= budget:
        while k < accepted and measured(k + 1) <= budget:
            k += 1
    while k and measured(k) > budget:
        k -= 1
    if not k:
        return None
    if k == top // unit:
        beyond = f"the search's top ({top})"
    elif k == accepted:
        beyond = at(k + 1).refused
    else:
        over = measured(k + 1)
        beyond = f"measured {over / MiB:.1f} MiB > budget (walk {at(k + 1).walk / MiB:.1f})"
    v = at(k)
    assert v.plan is not None
    return Largest(k * unit, v.walk, measured(k), beyond, modes(v.plan), accepted * unit)


Timed = dict[tuple[int, str], tuple[float, int]]
"""(size, policy) -> (median step seconds, measured peak bytes) of the sweep's runs."""


def largest_rows(found: dict[str, Largest | None], timed: Timed, tokens: Callable[[int], int]) -> list[list[str]]:
    """Table 1 of an axis: a row per policy, its largest size that trains and its figures there (the step
    time from the sweep's side-by-side run at that size)."""
    rows = []
    for p, f in found.items():
        if f is None:
            rows.append([p, "none", "", "", "", "", "", "", ""])
            continue
        t = timed[f.size, p][0]
        rows.append(
            [
                p,
                str(f.size),
                f.next_fails,
                str(f.accepted),
                f.modes,
                f"{f.walk / MiB:.2f}",
                f"{f.measured / MiB:.2f} ({f.measured / f.walk:.2f})",
                f"{t:.3f}",
                f"{tokens(f.size) / t:,.0f}",
            ]
        )
    return rows


def sweep(args: argparse.Namespace, axis: str, unit: int, found: dict[str, Largest | None]) -> tuple[list, Timed]:
    """Table 2 of an axis and its runs: at unit times powers of two and each policy's largest size, every
    policy the planner accepts run side by side, and keep one size past its largest (the first its walk
    refuses: its measured peak there); a cell is the median step seconds and the measured peak, marked where
    the size does not train."""
    budget, ends = int(args.budget_mb * MiB), [f.size for f in found.values() if f is not None]
    top = max(ends, default=0)
    past = {p: f.size + unit for p, f in found.items() if f is not None and f.next_fails.startswith("keep's walk")}
    sizes = sorted({unit << i for i in range(top.bit_length()) if unit << i <= top} | set(ends) | set(past.values()))
    rows, timed = [], {}
    for size in sizes:
        cfg = config(args, axis, size)
        verdicts = {p: verdict(p, cfg, budget, args.profile) for p in POLICIES}
        wanted = {
            p: v.plan for p, v in verdicts.items() if v.plan is not None and (not v.refused or size == past.get(p))
        }
        timed |= {
            (size, p): r
            for p, r in run({p: (cfg, plan) for p, plan in wanted.items()}, args.steps, args.min_seconds).items()
        }
        cells = []
        for p in POLICIES:
            if (size, p) not in timed:
                cells.append("-")
                continue
            t, peak = timed[size, p]
            mark = " (refused)" if verdicts[p].refused else (" **over**" if peak > budget else "")
            cells.append(f"{t:.3f} s, {peak / MiB:.1f} MiB{mark}")
        chosen, offload = verdicts["chosen"].plan, verdicts["offload"].plan
        rows.append([str(size), *cells, *(modes(p) if p is not None else "-" for p in (chosen, offload))])
        print(f"  {axis} {size}: " + "; ".join(f"{p} {c}" for p, c in zip(POLICIES, cells)))
    return rows, timed


HEADER = [
    "policy",
    "largest that trains",
    "one step more",
    "planner accepts up to",
    "stage modes there",
    "walk MiB",
    "measured MiB (/walk)",
    "step s there",
    "tokens/s there",
]


def axis_tables(args: argparse.Namespace, axis: str) -> str:
    """Both tables of one axis, as Markdown, with the line saying what is fixed."""
    unit, top = (1, args.max_microbatch) if axis == "microbatch" else (args.seq_unit, args.max_seq)
    found = {p: largest(p, args, axis, unit, top) for p in POLICIES}
    mb, seq, m = args.microbatch, args.seq_len, args.microbatches
    tokens = (lambda n: n * m * seq) if axis == "microbatch" else (lambda n: n * m * mb)
    fixed = f"seq_len {seq}" if axis == "microbatch" else f"microbatch {mb}"
    rows, timed = sweep(args, axis, unit, found)
    return (
        f"\n{axis} ({fixed}): the largest that trains\n"
        + markdown_table(HEADER, largest_rows(found, timed, tokens))
        + f"\n\n{axis} ({fixed}): step time and measured peak by size, run side by side\n"
        + markdown_table([axis, *POLICIES, "chosen's stage modes", "offload's"], rows)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--budget-mb", type=float, default=64.0, help="the stand-in's device memory (plan.device_memory_mb)")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="the microbatch search's sequence length")
    p.add_argument("--microbatch", type=int, default=1, help="the sequence-length search's microbatch size")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (after one untimed)")
    p.add_argument("--min-seconds", type=float, default=3.0, help="timed seconds per run at least (up to 6 x steps)")
    p.add_argument("--max-microbatch", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=4096)
    p.add_argument("--seq-unit", type=int, default=32, help="the sequence-length search's step")
    p.add_argument(
        "--profile", choices=["analytic", "measured"], default="measured", help="what the plans are made from"
    )
    p.add_argument("--axes", nargs="+", choices=["microbatch", "seq"], default=["microbatch", "seq"])
    args = p.parse_args()
    torch.set_num_threads(1)
    info, mark, out = machine(), cpu_mark(), []
    for axis in args.axes:
        print(f"searching {axis} ...")
        out.append(axis_tables(args, axis))
    share, wall = other_share(mark)
    print("\n".join(info))
    print(f"other processes kept {100 * share:.0f}% of the cores busy during the {wall:.0f} s run")
    print(
        f"GPT {args.blocks} blocks x d_model {args.d_model} ({args.heads} heads), {args.microbatches} microbatches, "
        f"{args.stages} stages on 1 rank, device budget {args.budget_mb:g} MiB, fp32, planned from the "
        f"{args.profile} profile"
    )
    print("\n".join(out))


if __name__ == "__main__":
    main()
