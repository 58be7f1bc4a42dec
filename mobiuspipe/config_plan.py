"""The plan of a run config's built-in GPT: its model spec, the CPU stand-ins it plans for, its analytic profile,
and the plan itself (read from plan.file and checked against the model, or made now)."""

from __future__ import annotations

import torch

from foundation.units import MiB
from mobiuspipe.config import DEFAULT_GPUS, RunConfig
from mobiuspipe.errors import ConfigError
from mobiuspipe.machine import discovered_topology
from partition import make_plan
from partition.analytic import analytic_profile, dtype_bytes
from partition.hardware import device_spec
from partition.models import ModelSpec, layer_param_counts
from partition.plan import Plan, load_plan
from partition.profile import Profile
from topology import Topology, cpu_standin, load_topology

__all__ = ["model_spec", "plan_for_config", "plan_from_config", "run_topology", "num_ranks", "gpt_profile"]


def model_spec(cfg: RunConfig) -> ModelSpec:
    """The partition package's description of the config's model (the built-in GPT or model.hf's)."""
    return cfg.model.spec()


def plan_for_config(cfg: RunConfig) -> Plan:
    """The config's plan file checked against the model, or a plan made for CPU stand-in devices."""
    spec = model_spec(cfg)
    if cfg.plan.file:
        plan = load_plan(cfg.plan.file)
        _check_matches(plan, spec, cfg)
        return plan
    return plan_from_config(cfg)


def run_topology(cfg: RunConfig) -> Topology:
    """The machine a run plans for: plan.topology (a preset or a layout file); else, with GPUs, this host's
    discovered topology narrowed to the first plan.num_gpus (default: all) CUDA devices; else plan.num_gpus
    CPU stand-ins of plan.device_memory_mb each. ConfigError when the gpu or stage count does not fit it."""
    p = cfg.plan
    if p.topology is None and torch.cuda.is_available():
        return discovered_topology(torch.cuda.device_count() if p.num_gpus is None else p.num_gpus)
    if p.topology is None:
        return cpu_standin(DEFAULT_GPUS if p.num_gpus is None else p.num_gpus, int(p.device_memory_mb * MiB))
    topo = load_topology(p.topology)  # a layout file's path is absolute: load_config made it so
    if p.num_gpus is not None and p.num_gpus != topo.num_gpus:
        raise ConfigError(
            f"config {cfg.source}: plan.num_gpus is {p.num_gpus} but plan.topology {p.topology!r} has "
            f"{topo.num_gpus} gpus; remove plan.num_gpus (the topology sets it) or set it to {topo.num_gpus}"
        )
    if p.num_stages < topo.num_gpus:
        raise ConfigError(
            f"config {cfg.source}: plan.num_stages is {p.num_stages} but plan.topology {p.topology!r} has "
            f"{topo.num_gpus} gpus, each needing a stage; raise plan.num_stages to at least {topo.num_gpus}"
        )
    return topo


def num_ranks(cfg: RunConfig) -> int:
    """Ranks the run needs: its plan file's gpu count, else its topology's (see run_topology)."""
    return load_plan(cfg.plan.file).num_gpus if cfg.plan.file else run_topology(cfg).num_gpus


def gpt_profile(cfg: RunConfig) -> Profile:
    """The analytic profile of the config's model in train.precision, on this gpu type (or the CPU stand-in)."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu-standin"
    return analytic_profile(
        model_spec(cfg), device_spec(device), microbatch_size=cfg.microbatch_size, dtype=cfg.train.precision
    )


def plan_from_config(cfg: RunConfig, solver: str = "dp") -> Plan:
    """The plan made from the config alone. Every rank makes it for itself, so the default is the exact
    DP, which is deterministic; a time-limited MIP could differ between ranks. `mobiuspipe partition
    --config` passes its --solver and writes the result for plan.file."""
    return make_plan(
        gpt_profile(cfg),
        run_topology(cfg),
        cfg.data.num_microbatches,
        num_stages=cfg.plan.num_stages,
        mapping=cfg.plan.mapping,
        solver=solver,
    )


def _check_matches(plan: Plan, spec: ModelSpec, cfg: RunConfig) -> None:
    where = f"plan.file ({cfg.plan.file})"
    counts = layer_param_counts(spec)
    if plan.num_layers != spec.num_layers:
        raise ConfigError(
            f"{where}: the plan has {plan.num_layers} layers but the model has {spec.num_layers}; "
            f"make a plan for this model or remove plan.file to plan at start-up"
        )
    if plan.dtype != cfg.train.precision:
        raise ConfigError(
            f"{where}: the plan is for {plan.dtype} weights but train.precision is {cfg.train.precision}; make "
            f"them equal (re-plan with `mobiuspipe partition --config ...` or set train.precision: {plan.dtype})"
        )
    size = dtype_bytes(plan.dtype)
    for j, s in enumerate(plan.stages):
        n = sum(counts[s.first : s.last + 1])
        if s.param_count != n or n * size > plan.slot_bytes:
            raise ConfigError(
                f"{where}: stage {j} (layers {s.first}..{s.last}) has {n} parameters ({n * size} {plan.dtype} "
                f"bytes) in this model, the plan says {s.param_count} in a {plan.slot_bytes}-byte slot; "
                f"the plan was made for another model or dtype: re-plan or remove plan.file"
            )
    if plan.num_microbatches != cfg.data.num_microbatches:
        raise ConfigError(
            f"{where}: the plan is for {plan.num_microbatches} microbatches, data.num_microbatches is "
            f"{cfg.data.num_microbatches}; make them equal"
        )
