"""The plan of a run config's built-in GPT: its model spec, the CPU stand-ins it plans for, its analytic profile,
and the plan itself (read from plan.file and checked against the model, or made now)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

from foundation.checked import Problem, format_problems, rule
from foundation.units import MiB, fmt_bytes
from mobiuspipe.config import DEFAULT_GPUS, RunConfig
from mobiuspipe.errors import ConfigError
from mobiuspipe.runtime.peers.ranks import local_world_size
from mobiuspipe.startup.lora import adapter_counts, adapter_kept, lora_spec
from mobiuspipe.startup.machine import discovered_topology
from mobiuspipe.startup.update_policy import UpdatePolicy
from partition.plan import Plan, load_plan
from partition.rules.device_peak import gpu_headroom
from partition.rules.placement import HostCopies
from partition.rules.tiers import HostBudget, RunMemory
from partition.search import plan_batch
from partition.spec.analytic import analytic_profile, dtype_bytes
from partition.spec.hardware import LIBRARY_BYTES, topology_gpu_spec
from partition.spec.lora import FrozenBase, frozen_layers
from partition.spec.models import ModelSpec, layer_param_counts
from partition.spec.profile import Profile
from topology import Topology, cpu_standin, load_topology
from topology.presets import STANDIN_MESSAGES, reserve_bytes

__all__ = [
    "model_spec",
    "activation_tiers",
    "plan_for_config",
    "plan_problems",
    "replan_advice",
    "plan_from_config",
    "profile_count",
    "run_budget",
    "run_topology",
    "num_ranks",
    "gpt_profile",
    "with_run_library_bytes",
    "with_run_workspaces",
    "adapters",
    "frozen_base",
]


def model_spec(cfg: RunConfig) -> ModelSpec:
    """The partition package's description of the config's model (the built-in GPT or model.hf's)."""
    return cfg.model.spec()


def plan_for_config(cfg: RunConfig) -> Plan:
    """The config's plan file checked against the model, or a plan made for CPU stand-in devices."""
    if cfg.plan.file:
        plan = load_plan(cfg.plan.file)
        problems = plan_problems(plan, cfg)
        if problems:
            raise ConfigError(format_problems(f"config {cfg.source}", problems))
        return with_run_workspaces(cfg, plan)
    return plan_from_config(cfg)


def with_run_workspaces(cfg: RunConfig, plan: Plan) -> Plan:
    """A plan file's plan with W (Plan.workspace_bytes) as the run's math libraries will hold it
    (with_run_library_bytes): under runtime.deterministic at least LIBRARY_BYTES, the difference taken out of its
    usable memory (its share of the gpu stays), so that the walk's figure and the start-up room check count it. A
    plan whose stages record no X_j (made before they did, its workspace_bytes holding the largest X too, or from a
    profile without W) is left alone."""
    w = plan.workspace_bytes
    if not (cfg.runtime.deterministic and 0 < w < LIBRARY_BYTES and any(s.transient_bytes for s in plan.stages)):
        return plan
    more = LIBRARY_BYTES - w
    raised = dataclasses.replace(plan, workspace_bytes=LIBRARY_BYTES, gpu_memory_bytes=plan.gpu_memory_bytes - more)
    left = gpu_headroom(raised)
    if min(left) < 0:
        g = left.index(min(left))
        raise ConfigError(
            f"config {cfg.source}: runtime.deterministic gives cuBLAS workspaces of {fmt_bytes(LIBRARY_BYTES)} per "
            f"stream, but plan.file {cfg.plan.file} holds {fmt_bytes(w)} apart for them (its profile was measured "
            f"without them), and with the {fmt_bytes(more)} more gpu {g} needs {fmt_bytes(-left[g])} more than the "
            f"plan's usable memory; {replan_advice(cfg, 'for them')} (with --profile FILE when the plan was made from "
            "a measured profile), or set runtime.deterministic false"
        )
    return raised


def run_topology(cfg: RunConfig) -> Topology:
    """The machine a run plans for: plan.topology (a preset or a layout file); else, with GPUs, this host's
    discovered topology narrowed to the first plan.num_gpus (default: all) CUDA devices; else plan.num_gpus
    CPU stand-ins of plan.device_memory_mb each, whose messages cost what they typically do (STANDIN_MESSAGES).
    ConfigError when the gpu or stage count does not fit it."""
    p = cfg.plan
    if p.topology is None and torch.cuda.is_available():
        return discovered_topology(torch.cuda.device_count() if p.num_gpus is None else p.num_gpus)
    if p.topology is None:
        n = DEFAULT_GPUS if p.num_gpus is None else p.num_gpus
        return cpu_standin(n, int(p.device_memory_mb * MiB), measured=STANDIN_MESSAGES)
    topo = load_topology(p.topology)  # a layout file's path is absolute: load_config made it so
    if p.num_gpus is not None and p.num_gpus != topo.num_gpus:
        raise ConfigError(
            f"config {cfg.source}: plan.num_gpus is {p.num_gpus} but plan.topology {p.topology!r} has "
            f"{topo.num_gpus} gpus; remove plan.num_gpus (the topology sets it) or set it to {topo.num_gpus}"
        )
    if p.num_stages is not None and p.num_stages < topo.num_gpus:
        raise ConfigError(
            f"config {cfg.source}: plan.num_stages is {p.num_stages} but plan.topology {p.topology!r} has "
            f"{topo.num_gpus} gpus, each needing a stage; raise plan.num_stages to at least {topo.num_gpus}"
        )
    return topo


def num_ranks(cfg: RunConfig) -> int:
    """Ranks the run needs: its plan file's gpu count, else its topology's (see run_topology)."""
    return load_plan(cfg.plan.file).num_gpus if cfg.plan.file else run_topology(cfg).num_gpus


def gpt_profile(cfg: RunConfig, microbatch_size: int | None = None, topo: Topology | None = None) -> Profile:
    """The analytic profile of the config's model in train.precision, on the run's gpu 0 (its layout's tflops, the
    table's figure for its name, or the matmul rate its probe measured) or the CPU stand-in, for microbatches of
    `microbatch_size` sequences (default: the config's; the whole batch when the planner chooses them,
    data.num_microbatches auto); topo: run_topology(cfg) where the caller has it (a gpu's spec for a server planned
    from a host without one too)."""
    device = topology_gpu_spec(topo or run_topology(cfg))
    spec = model_spec(cfg)
    return analytic_profile(
        spec,
        device,
        microbatch_size=microbatch_size or cfg.microbatch_size or cfg.data.batch_size,
        dtype=cfg.train.precision,
        adapters=adapters(cfg),
        frozen=frozen_base(cfg),
        adapter_kept=kept_by_adapters(cfg, device.mask_bytes(dtype_bytes(cfg.train.precision))),
    )


def frozen_base(cfg: RunConfig) -> FrozenBase | None:
    """Each layer's frozen base when the run keeps it quantized (lora.base_dtype; None: in the training dtype, or no
    LoRA)."""
    spec = lora_spec(cfg)
    if spec is None or spec.base_dtype is None:
        return None
    return frozen_layers(model_spec(cfg), dtype_bytes(cfg.train.precision), spec.base_dtype)


@lru_cache(maxsize=8)
def kept_by_adapters(cfg: RunConfig, mask_bytes: int) -> tuple[int, ...] | None:
    """The bytes a token each layer's LoRA adapters keep for backward in train.precision, with dropout masks of
    mask_bytes an element (the device's: DeviceSpec.mask_bytes); None: no LoRA."""
    spec = lora_spec(cfg)
    return None if spec is None else tuple(adapter_kept(cfg, spec, dtype_bytes(cfg.train.precision), mask_bytes))


@lru_cache(maxsize=8)
def adapters(cfg: RunConfig) -> tuple[int, ...] | None:
    """The LoRA adapter parameters of each layer of the config's model (None: no LoRA, every weight trains); counted
    once per config (on layers built on the meta device)."""
    spec = lora_spec(cfg)
    return None if spec is None else tuple(adapter_counts(cfg, spec))


def plan_from_config(
    cfg: RunConfig, solver: str = "auto", profile: Profile | None = None, hosts: int = 1, **mip: float
) -> Plan:
    """The plan made from the config alone (its analytic profile, or `profile` of its model) by the whole planner, as
    `mobiuspipe partition` makes it: the microbatch count and size searched for data.batch_size
    (data.num_microbatches auto; partition.search.plan_batch), the stage count searched (plan.num_stages auto) with
    the MIP (`solver`), the activation choice, and each stage's tiers placed by the run's memory settings
    (run_budget), each gpu's plan.reserve_mb left alone (topology.presets.reserve_bytes); mip: the MIP's
    time_limit_s and gap (partition.make_plan's defaults where absent). `mobiuspipe train` makes it once and hands
    it to its ranks; ranks under a plain torchrun each make it and compare it. `mobiuspipe partition --config`
    passes its --solver, --profile, --time-limit, --gap and --reserve-gib and writes the result for plan.file.
    hosts: the machines the job spans (`mobiuspipe train --nnodes`; activation_tiers)."""
    topo = run_topology(cfg)
    given = None if profile is None else with_run_library_bytes(cfg, profile)
    return plan_batch(
        lambda size: gpt_profile(cfg, size, topo) if given is None else given,
        cfg.data.batch_size,
        topo,
        cfg.data.num_microbatches if profile is None else profile_count(cfg, profile),
        num_stages=cfg.plan.num_stages,
        mapping=cfg.plan.mapping,
        solver=solver,
        reserve_bytes=reserve_bytes(topo, cfg.plan.reserve_mb),
        **mip,
        host_budget=run_budget(cfg),
        activation_tiers=activation_tiers(cfg, hosts),
    )


def with_run_library_bytes(cfg: RunConfig, profile: Profile) -> Profile:
    """`profile` with W (Profile.library_bytes) as the run's math libraries will hold it: runtime.deterministic gives
    cuBLAS a 32 MiB workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), which a profile measured without it did not have
    (torch's default before Hopper is 8.125 MiB), so W is at least LIBRARY_BYTES (65 MiB: two 32 MiB workspaces,
    cuBLAS's and cuBLASLt's, as the H200 measured). A profile with no W (measured on the stand-in) is left alone."""
    if not (cfg.runtime.deterministic and 0 < profile.library_bytes < LIBRARY_BYTES):
        return profile
    return dataclasses.replace(profile, library_bytes=LIBRARY_BYTES)


def profile_count(cfg: RunConfig, profile: Profile) -> int:
    """The microbatches of data.batch_size a profile's microbatch size makes; ConfigError when it does not divide the
    batch, or makes another count than data.num_microbatches fixes."""
    size, batch, count = profile.microbatch_size, cfg.data.batch_size, cfg.data.num_microbatches
    if batch % size or (count is not None and count * size != batch):
        fixed = f" in data.num_microbatches {count}" if count is not None else ""
        raise ConfigError(
            f"config {cfg.source}: the profile's microbatches of {size} sequences do not make data.batch_size {batch}"
            f"{fixed}: profile the model at a microbatch size that does (data.batch_size / data.num_microbatches), or "
            f"set data.batch_size to a multiple of {size}"
        )
    return batch // size


def run_budget(cfg: RunConfig) -> HostBudget:
    """The planner's host budget for a run: each rank's states placed by memory.optimizer and memory.weights under
    memory.host_budget_mb, the frozen base where memory.frozen says (partition.rules.tiers.RunMemory)."""
    mem, copies = cfg.memory, run_copies(cfg)
    run = RunMemory(mem.optimizer, mem.weights, mem.frozen, int(mem.host_budget_mb * MiB))
    source = f"memory.host_budget_mb {mem.host_budget_mb:g} MiB per rank for the states"
    return HostBudget(
        None, source, run, delayed=copies.versions > 1, speculative=copies.undo, accumulates=copies.accumulates
    )


def run_copies(cfg: RunConfig) -> HostCopies:
    """What each stage of the run keeps in host memory beyond its states (UpdatePolicy.copies)."""
    t = cfg.train
    checked = t.max_grad_norm is not None or t.precision == "fp16"
    policy = UpdatePolicy(checked, delayed_update=t.delayed_update, speculative=t.speculative_update)
    return dataclasses.replace(policy, accumulates=t.accumulation_steps > 1).copies


def activation_tiers(cfg: RunConfig, hosts: int = 1) -> tuple[str, ...]:
    """The tiers off the device the planner may hold activations on for this run: the host; the SSD when
    memory.ssd_dir is set; the next rank's gpu when the run has several, all on this host (partition.rules.peer;
    several hosts: `hosts` > 1, as a multi-node launcher knows before torchrun runs, or torchrun's
    LOCAL_WORLD_SIZE below the rank count, as its ranks see it)."""
    n = num_ranks(cfg)
    one_host = hosts == 1 and local_world_size(n) >= n
    return ("host",) + (("ssd",) if cfg.memory.ssd_dir else ()) + (("peer",) if n > 1 and one_host else ())


def plan_problems(plan: Plan, cfg: RunConfig) -> list[Problem]:
    """Everything in which plan.file's plan does not fit the config: the model (name, layers, each stage's
    parameters), train.precision, the microbatches (count and size); each Problem names the config key."""
    spec, file = model_spec(cfg), cfg.plan.file
    replan = replan_advice(cfg, "for this config")
    made = f"as in plan.file {file}"
    problems = rule(
        plan.model == spec.name,
        "plan.file",
        f"a plan for this config's model {spec.name!r}",
        f"a plan for {plan.model!r}",
        replan,
    )
    if plan.num_layers != spec.num_layers:
        problems += [
            Problem(
                "plan.file",
                f"a plan cutting the model's {spec.num_layers} layers",
                f"a plan for {plan.num_layers} layers",
                f"{replan}, or remove plan.file to plan at start-up",
            )
        ]
    else:
        problems += _stage_problems(plan, spec, adapters(cfg), frozen_base(cfg), replan)
    problems += rule(
        plan.dtype == cfg.train.precision,
        "train.precision",
        f"{plan.dtype} ({made})",
        cfg.train.precision,
        f"{replan}, or set train.precision: {plan.dtype}",
    )
    return problems + _microbatch_problems(plan, cfg, made, replan)


def replan_advice(cfg: RunConfig, what: str) -> str:
    """How to re-plan (`what`: for which config) into a new file beside plan.file, which is kept (partition's -o
    would replace it)."""
    file = Path(str(cfg.plan.file))
    new = file.with_name(f"{file.stem}.new{file.suffix}")
    command = f"`mobiuspipe partition --config {cfg.source} -o {new}`"
    return f"re-plan {what} into a new file, {command}, then set plan.file: {new}"


def _stage_problems(
    plan: Plan, spec: ModelSpec, lora: Sequence[int] | None, frozen: FrozenBase | None, replan: str
) -> list[Problem]:
    """Stages whose parameters in this model (with its LoRA adapters: `lora` per layer; its base kept as `frozen`
    says: items per layer) differ from the plan's (all of them, and those that train) or overflow its slot (one
    Problem)."""
    base, size = (layer_param_counts(spec) if frozen is None else frozen.items), dtype_bytes(plan.dtype)
    trains = base if lora is None else lora
    counts = base if lora is None else [n + a for n, a in zip(base, lora)]
    wrong = []
    for j, s in enumerate(plan.stages):
        n, t = sum(counts[s.first : s.last + 1]), sum(trains[s.first : s.last + 1])
        if s.param_count != n or s.trains != t or (frozen is None and n * size > plan.slot_bytes):
            here, there = (f" ({t} train)", f" ({s.trains} train)") if lora is not None or s.trains != n else ("", "")
            wrong.append(
                f"stage {j} (layers {s.first}..{s.last}) has {n} parameters here{here}, {s.param_count} in the "
                f"plan{there}"
            )
    shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more stages" if len(wrong) > 3 else "")
    return rule(
        not wrong,
        "plan.file",
        f"each stage's parameters as this model has them, within the plan's {plan.slot_bytes}-byte slot",
        f"{shown} (a plan for another model or dtype)",
        f"{replan}, or remove plan.file to plan at start-up",
    )


def _microbatch_problems(plan: Plan, cfg: RunConfig, made: str, replan: str) -> list[Problem]:
    """data.num_microbatches and the microbatch size (data.batch_size / num_microbatches) against the plan's;
    both give the same fix, the settings that make the plan's microbatches."""
    d, count, size = cfg.data, plan.num_microbatches, plan.microbatch_size
    batch = count * size
    if d.num_microbatches is None:  # auto: the plan's count, which must make the batch
        return rule(
            d.batch_size == batch,
            "data.batch_size",
            f"{batch} sequences ({made}: {count} microbatches of {size})",
            str(d.batch_size),
            f"{replan}, or set data.batch_size: {batch}",
        )
    settings = [f"data.num_microbatches: {count}"] * (d.num_microbatches != count)
    settings += [f"data.batch_size: {batch}"] * (d.batch_size != batch)
    fix = f"{replan}, or set {' and '.join(settings)}"
    return rule(
        d.num_microbatches == count, "data.num_microbatches", f"{count} ({made})", str(d.num_microbatches), fix
    ) + rule(
        cfg.microbatch_size == size,
        "data.batch_size",
        f"microbatches of {size} sequences ({made}: data.batch_size {batch} in {count} microbatches)",
        f"data.batch_size {d.batch_size} in {d.num_microbatches} microbatches of {cfg.microbatch_size}",
        fix,
    )
