"""`mobiuspipe partition`: plan a model on a topology, then print the plan as a table and a timeline, or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

from foundation.units import GiB
from mobiuspipe.cli._common import CliError, non_negative_float, positive_int, ranks_per_node, write_output
from partition.plan import Plan, save_plan
from partition.report.compare import compare, compare_json, compare_text
from partition.report.explain import explain_json, explain_lines
from partition.report.plan_view import plan_to_json, render_plan
from partition.report.trace import svg_timeline
from partition.rules.activation_choice import Choice, with_activations
from partition.rules.tiers import HostBudget, activation_host_caps, host_budget
from partition.search import make_plan, predict_step
from partition.spec.analytic import analytic_profile, dtype_bytes
from partition.spec.hardware import topology_gpu_spec
from partition.spec.lookup import get_model
from partition.spec.lora import BASE_DTYPES, LoraShape, adapter_counts, adapter_kept, default_targets, frozen_layers
from partition.spec.models import ModelSpec
from partition.spec.profile import Profile, load_profile
from topology import PRESETS, Topology, load_topology
from topology.presets import reserve_bytes

__all__ = ["register", "run"]


def register(sub) -> None:
    """Add the `partition` subcommand to the CLI's subparsers."""
    p = sub.add_parser("partition", help="cut a model into stages, map them to gpus and predict the step")
    p.add_argument("--model", help="model name, e.g. gpt3-175b (an unknown name lists them all)")
    p.add_argument("--topology", help='preset name ("2+2", "3+1") or a .yaml/.json layout file')
    p.add_argument(
        "--config",
        metavar="RUN.yaml",
        help="plan a training run's model on its devices instead (then write it with -o for plan.file)",
    )
    p.add_argument(
        "--nnodes",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --config: plan for a job over N machines, as `mobiuspipe train --nnodes N` does (no peer "
        "activation tier, whose two ranks must share a host) (1)",
    )
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="sequences per microbatch (1)")
    p.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per step (4)")
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help="number of stages S (gpus <= S <= layers); default: search every S, keep the fastest",
    )
    p.add_argument(
        "--mapping",
        choices=("cross", "round-robin", "search"),
        default="cross",
        help="stage->gpu rule: cross (least contention), round-robin, search (every cyclic gpu order, "
        "up to 4 gpus; the fastest wins) (cross)",
    )
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="parameter dtype (fp16)")
    p.add_argument(
        "--lora",
        type=positive_int,
        metavar="RANK",
        help="plan LoRA fine-tuning: adapters of this rank train, the base weights are frozen (streamed "
        "read-only: no gradient, no offload, no optimizer state)",
    )
    p.add_argument(
        "--base-dtype",
        choices=BASE_DTYPES,
        help="with --lora: keep and stream the frozen base in this form: int8 (a byte per weight of each linear "
        "layer, a scale per output feature) or nf4 (QLoRA's 4-bit NormalFloat, about 0.52 bytes per weight of each "
        "linear layer whose size torchao's blocks divide); default: --dtype",
    )
    p.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="with --lora: comma-separated linear layers that get adapters, named as PEFT's target_modules "
        "(e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj); default: PEFT's for the model "
        "(q_proj,v_proj for a llama, c_attn for a gpt)",
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="with --lora: the adapters' dropout probability (PEFT's lora_dropout), which keeps each target's "
        "dropped input and mask for backward (default 0)",
    )
    p.add_argument(
        "--reserve-gib",
        type=non_negative_float,
        default=None,
        help="GiB of each gpu kept out of the plan for the CUDA context, NCCL and the allocator (1.0 on real gpus, "
        "0 on CPU stand-ins; with --config, its plan.reserve_mb)",
    )
    p.add_argument(
        "--host-memory-gb",
        metavar="GB",
        help="host memory (GiB, 2^30 bytes, as DRAM is sized) of the whole server, split evenly over its gpus; "
        "each gpu's share holds its saved stage inputs, then its stages' states as a rank with that "
        "memory.host_budget_mb would: what does not fit goes to the SSD, optimizer states first, then the "
        "weights with their gradients, largest stages first (default: the topology's host memory when it "
        "records it, else unlimited)",
    )
    p.add_argument(
        "--delayed-update",
        action="store_true",
        help="plan a run with the delayed update (train.delayed_update): each step's host updates run during the "
        "next step, so the step is the longer of the pipeline and the updates",
    )
    p.add_argument(
        "--activation-tiers",
        default="host",
        metavar="TIERS",
        help="comma-separated tiers off the device where the planner may hold a stage's activations between "
        "its forward and backward: host, ssd (the run then needs memory.ssd_dir), peer (the next gpu's "
        "memory) (host)",
    )
    p.add_argument(
        "--solver",
        choices=("auto", "highs", "gurobi", "dp"),
        default="auto",
        help="auto: Gurobi when its license admits the model, else HiGHS; dp: the exact DP alone (auto)",
    )
    p.add_argument(
        "--time-limit",
        type=non_negative_float,
        default=2.0,
        metavar="S",
        help=(
            "seconds the MIP solver may take in all, shared by the candidate stage counts (at least 0.05 s each); "
            "the planner's other work (the models' rows, the activation choice) comes on top. On a time-out the "
            "best plan found is kept with its gap (2)"
        ),
    )
    p.add_argument("--gap", type=non_negative_float, default=0.01, help="relative MIP gap to stop at (0.01 = 1%%)")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="use this profile (from `mobiuspipe profile -o`) instead of the analytic one of --model",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also predict sequential mapping, DeepSpeed ZeRO-3 offload and GPipe on the same topology",
    )
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan here (.yaml, or .json by suffix)")
    p.add_argument("--timeline", metavar="FILE.svg", help="write an SVG Gantt chart of the predicted step")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also print, per stage, every activation policy weighed (recompute, selective, keep and the tiers) "
        "with its predicted bytes and time, and why the chosen one won",
    )
    p.set_defaults(func=run)


def budget_of(args: argparse.Namespace, topo: Topology) -> HostBudget:
    """The host budget of --host-memory-gb (GiB), else the topology's; CliError for a value that is not > 0."""
    text, delayed = getattr(args, "host_memory_gb", None), bool(getattr(args, "delayed_update", False))
    if text is None:
        return dataclasses.replace(host_budget(topo), delayed=delayed)
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise CliError(
            f"--host-memory-gb: expected a positive number of GiB, the host memory of the whole server, found "
            f"{text!r}: give the server's DRAM (e.g. --host-memory-gb 512), or leave the option out to use the "
            f"topology's (unlimited when it does not record it)"
        )
    return dataclasses.replace(host_budget(topo, int(gib * GiB)), delayed=delayed)


def make_cli_plan(args: argparse.Namespace) -> tuple[Plan, Topology, Profile, HostBudget]:
    """The plan `partition` prints, its topology, profile and host budget: a run config's (as its run makes it), or
    an analytic profile of --model on --topology under --host-memory-gb."""
    if args.config:
        return _config_plan(args)
    if args.nnodes is not None:
        raise CliError(
            "--nnodes plans a run config for several machines (with --config); with --model the tiers are "
            "--activation-tiers: leave peer out of them for a job over several machines"
        )
    if not (args.model and args.topology):
        raise CliError(
            "partition needs --model and --topology (e.g. --model gpt3-175b --topology 2+2), "
            "or --config FILE.yaml to plan a training run's model"
        )
    spec = get_model(args.model)
    topo = load_topology(args.topology)
    try:
        device = topology_gpu_spec(topo)
    except ValueError as e:
        raise CliError(f"topology {topo.name!r}, gpu 0: {e}") from e
    smallest = min(g.memory_bytes for g in topo.gpus)
    reserve = reserve_bytes(topo, None if args.reserve_gib is None else args.reserve_gib * 1024)
    if reserve >= smallest:
        raise CliError(
            f"--reserve-gib {reserve / GiB:g} leaves no memory: the smallest gpu of topology "
            f"{topo.name!r} has {smallest / GiB:.2f} GiB; expected a reserve below that (default 1.0)"
        )
    lora = lora_of(args, spec)
    adapters = None if lora is None else adapter_counts(spec, lora)
    width = dtype_bytes(args.dtype)
    if args.profile and adapters is not None:
        raise CliError(
            "--lora with --profile: a profile file holds the layers it measured, adapters or not; expected one "
            "of them: drop --profile to plan LoRA on the analytic profile, or profile the adapted layers"
        )
    profile = (
        _given_profile(args.profile, spec)
        if args.profile
        else analytic_profile(
            spec,
            device,
            microbatch_size=args.microbatch_size,
            dtype=args.dtype,
            adapters=adapters,
            frozen=frozen_layers(spec, width, args.base_dtype) if args.base_dtype else None,
            adapter_kept=None if lora is None else adapter_kept(spec, lora, width, device.mask_bytes(width)),
        )
    )
    budget = budget_of(args, topo)
    plan = make_plan(
        profile,
        topo,
        args.microbatches,
        num_stages=args.stages,
        mapping=args.mapping,
        reserve_bytes=reserve,
        solver=args.solver,
        time_limit_s=args.time_limit,
        gap=args.gap,
        host_budget=budget,
        activation_tiers=activation_tiers_of(args),
    )
    return plan, topo, profile, budget


def lora_of(args: argparse.Namespace, spec: ModelSpec) -> LoraShape | None:
    """The adapters --lora, --lora-targets and --lora-dropout ask for (None without --lora); CliError for those
    flags without --lora, a dropout that is no probability or a target that names no linear layer of the model."""
    targets, dropout = getattr(args, "lora_targets", None), getattr(args, "lora_dropout", 0.0)
    if args.lora is None:
        if targets:
            raise CliError(f"--lora-targets {targets!r} without --lora: give the adapters' rank, e.g. --lora 16")
        if dropout:
            raise CliError(f"--lora-dropout {dropout:g} without --lora: give the adapters' rank, e.g. --lora 16")
        if getattr(args, "base_dtype", None):
            raise CliError(
                f"--base-dtype {args.base_dtype} without --lora: only a frozen base is quantized; add --lora"
            )
        return None
    if not 0 <= dropout < 1:
        raise CliError(f"--lora-dropout: expected a probability in [0, 1), found {dropout:g}")
    names = tuple(t.strip() for t in (targets or "").split(",") if t.strip()) or default_targets(spec)
    lora = LoraShape(args.lora, names, dropout)
    try:
        adapter_counts(spec, lora)
    except ValueError as e:
        raise CliError(f"--lora-targets: {e}; give some of those names") from e
    return lora


def activation_tiers_of(args: argparse.Namespace) -> tuple[str, ...]:
    """--activation-tiers as a tuple; CliError naming a tier that is not host or ssd."""
    tiers = tuple(t.strip() for t in args.activation_tiers.split(",") if t.strip())
    wrong = [t for t in tiers if t not in ("host", "ssd", "peer")]
    if wrong or not tiers:
        raise CliError(
            f"--activation-tiers {args.activation_tiers!r}: expected a comma-separated list of host, ssd and "
            f"peer, e.g. `--activation-tiers host,ssd`"
        )
    return tiers


def _explained(plan: Plan, profile: Profile, topo: Topology, caps: list[int], tiers: tuple[str, ...]) -> Choice:
    """The activation choice of the plan, weighed option by option: made again from the start the plan's came from
    (make_plan keeps the start whose placed plan predicts the shorter step; the plan does not record which)."""
    chosen = [(s.activations, s.activation_tier) for s in plan.stages]
    first = None
    for start in ("device", "host") if "host" in tiers else ("device",):  # as make_plan's starts
        choice = with_activations(
            plan, profile, topo, plan.gpu_memory_bytes, explain=True, host_caps=caps, tiers=tiers, starts=(start,)
        )[1]
        if [(p.mode, p.tier) for p in choice.policies] == chosen:
            return choice
        first = first or choice
    assert first is not None
    return first


def _given_profile(path: str, spec: ModelSpec) -> Profile:
    """The profile file at `path`, which must be one of --model's: its model name and its layer count."""
    profile = load_profile(path)
    if profile.model.lower() != spec.name.lower() or profile.num_layers != spec.num_layers:
        raise CliError(
            f"--profile {path} is a profile of model {profile.model!r} ({profile.num_layers} layers), but --model "
            f"is {spec.name!r} ({spec.num_layers} layers): give --model {profile.model} to plan the profiled "
            f"model, or profile {spec.name} with `mobiuspipe profile --model {spec.name} -o FILE` and pass that"
        )
    return profile


def _config_plan(args: argparse.Namespace) -> tuple[Plan, Topology, Profile, HostBudget]:
    """The plan `mobiuspipe train` makes at start-up for this config (model, devices, stages, mapping, tiers)."""
    given = [f for f in ("model", "stages", "host_memory_gb") if getattr(args, f) is not None]
    given += ["delayed_update"] if getattr(args, "delayed_update", False) else []
    if given:
        got = ", --".join(g.replace("_", "-") for g in given)
        raise CliError(
            f"--config takes the model, stages, host memory and delayed update from its file (plan.num_stages, "
            f"memory.host_budget_mb per rank, train.delayed_update); found --{got}: drop them or drop --config"
        )
    from mobiuspipe.config import load_config
    from mobiuspipe.startup.config_plan import (
        activation_tiers,
        gpt_profile,
        model_spec,
        num_ranks,
        plan_from_config,
        run_budget,
        run_topology,
        with_run_library_bytes,
    )

    cfg = load_config(args.config)
    if args.topology is not None:  # plan the run for another machine than its config names
        topology = args.topology if args.topology in PRESETS else os.path.abspath(args.topology)  # cwd-relative
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, topology=topology, num_gpus=None))
    if args.reserve_gib is not None:  # leave another reserve than the run's plan.reserve_mb
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, reserve_mb=args.reserve_gib * 1024))
    given = None if args.profile is None else _given_profile(args.profile, model_spec(cfg))
    hosts = args.nnodes or 1
    ranks_per_node(num_ranks(cfg), hosts)  # every machine starts as many ranks
    args.activation_tiers = ",".join(activation_tiers(cfg, hosts))  # as the run plans (--explain too)
    plan = plan_from_config(cfg, args.solver, given, hosts, time_limit_s=args.time_limit, gap=args.gap)
    topo = run_topology(cfg)
    # the profile the plan was made from, for --compare and --explain (the chosen microbatches' analytic one)
    profile = with_run_library_bytes(cfg, given) if given else gpt_profile(cfg, plan.microbatch_size, topo)
    return plan, topo, profile, run_budget(cfg)


_COMPARE_NOTE = (
    "compare: every system with its states in host memory (the host budget and its SSD traffic are not "
    "applied to the comparison)"
)


def run(args: argparse.Namespace, out) -> int:
    """Plan, write -o/--timeline files, print the plan to `out`; errors propagate to the CLI's handler."""
    plan, topo, profile, budget = make_cli_plan(args)
    pred = predict_step(plan, topo, budget)
    plan, sim = pred.plan, pred.sim
    notes = []
    if args.output:
        write_output("plan", args.output, lambda: save_plan(plan, args.output))
        notes.append(f"plan written to {args.output}")
    if args.timeline:
        title = (
            f"{plan.model} on {plan.topology}: {plan.num_stages} stages on {plan.num_gpus} gpus, "
            f"predicted step {plan.predicted_step_time_s:.3f} s"
        )
        write_output("timeline", args.timeline, lambda: svg_timeline(sim, topo.num_gpus, Path(args.timeline), title))
        notes.append(f"timeline written to {args.timeline}")
    doc, extra = plan_to_json(plan, pred), ""
    if args.compare:
        results = compare(plan, topo, profile, budget.delayed)
        doc["compare"] = compare_json(plan, topo, profile, results)
        extra = "\n" + compare_text(plan, topo, profile, results, budget.delayed)
        if pred.memory.ssd_bytes:
            doc["compare"]["note"] = _COMPARE_NOTE
            extra += _COMPARE_NOTE + "\n"
    if args.explain:
        try:
            caps = activation_host_caps(plan, budget)
            tiers = activation_tiers_of(args)
            choice = _explained(plan, profile, topo, caps, tiers)
            doc["explain"], lines = explain_json(choice), explain_lines(plan, choice)
        except ValueError as e:  # the walk does not fit even recomputing: the plan keeps the memory rule's cut
            doc["explain"], lines = [], [f"activations: no choice: {e}; every stage recomputes"]
        extra += "\n" + "\n".join(lines) + "\n"
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(render_plan(plan, sim, pred=pred) + extra + "".join(n + "\n" for n in notes))
    return 0
