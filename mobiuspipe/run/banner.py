"""The line a run starts with (rank 0, once every rank has set up): the model and its plan, LoRA's adapters, where
each stage's states, weights and held activations live, and the data."""

from __future__ import annotations

from foundation.units import fmt_bytes, fmt_spans
from mobiuspipe.config import RunConfig
from mobiuspipe.startup.lora import lora_spec
from partition.plan import Plan

__all__ = ["start_line", "states_line", "activations_line", "writes"]


def start_line(cfg: RunConfig, plan: Plan, state_tiers: dict[int, tuple[str, str]], data: str) -> str:
    """The whole line: plan (as the run runs it: Pipeline.plan), state tiers (Pipeline.state_tiers), data (what
    the data are, PackedTokens.describe)."""
    return f"{_run_words(cfg, plan)}; {states_line(cfg, state_tiers)}; {activations_line(plan)}; data: {data}"


def _run_words(cfg: RunConfig, plan: Plan) -> str:
    source = f"from {cfg.plan.file}" if cfg.plan.file else "made at start-up"
    return (
        f"mobiuspipe: {plan.model}, {plan.num_layers} layers in {plan.num_stages} stages on {plan.num_gpus} "
        f"ranks (stage -> rank {plan.mapping}, {plan.mapping_rule} mapping; plan {source}); "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size}; {plan.dtype} weights, fp32 master; "
        f"device arena "
        f"{fmt_bytes(plan.arena_bytes)} per rank ({plan.arena_words()})" + _lora_words(cfg, plan) + writes(cfg)
    )


def _lora_words(cfg: RunConfig, plan: Plan) -> str:
    """What the banner says of LoRA: the adapters and what trains (nothing without LoRA)."""
    spec = lora_spec(cfg)
    if spec is None:
        return ""
    trains, frozen = sum(s.trains for s in plan.stages), sum(s.frozen_bytes for s in plan.stages)
    start = f"continuing {cfg.model.adapter}" if cfg.model.adapter else "new"
    form = {"nf4": "NF4", "int8": "int8"}.get(spec.base_dtype or "", plan.dtype)
    where = "on the SSD, " if cfg.memory.frozen == "ssd" else ""
    return (
        f"; LoRA adapters ({start}) of rank {spec.rank}, alpha {spec.alpha:g} on {', '.join(spec.targets)}: "
        f"{trains:,} parameters train, the base frozen ({where}{fmt_bytes(frozen)} in {form})"
    )


def writes(cfg: RunConfig) -> str:
    """What the banner says when the run writes no files (a config without out_dir, an empty one among them)."""
    if cfg.train.out_dir or cfg.train.checkpoint_root or cfg.train.export_dir:
        return ""
    return "; no train.out_dir: this run writes no files (no metrics, checkpoints or weights)"


def states_line(cfg: RunConfig, tiers: dict[int, tuple[str, str]]) -> str:
    """Where each stage's optimizer states and weights went, e.g. "optimizer states (auto): host for stages 1-3;
    ssd for stage 0; weights (host): host for stages 0-3 (under /nvme/run, 1024 MiB host budget per rank)"."""
    mem = cfg.memory
    line = "; ".join(
        f"{what} ({mode}): {_by_tier({j: t[k] for j, t in tiers.items()})}"
        for k, (what, mode) in enumerate((("optimizer states", mem.optimizer), ("weights", mem.weights)))
    )
    on_ssd = any("ssd" in t for t in tiers.values())
    return line + (f" (under {mem.ssd_dir}, {mem.host_budget_mb:g} MiB host budget per rank)" if on_ssd else "")


def _by_tier(tiers: dict[int, str]) -> str:
    parts = []
    for tier in ("device", "host", "ssd"):
        stages = sorted(j for j, t in tiers.items() if t == tier)
        if stages:
            parts.append(f"{tier} for stage{'s' if len(stages) > 1 else ''} {fmt_spans(stages)}")
    return "; ".join(parts)


def activations_line(plan: Plan) -> str:
    """What each stage keeps for its backward and where it waits (the plan as the run runs it), e.g. "activations:
    keep on device for stages 0, 85-92, 97; recompute, inputs on host for stages 1-84, 93-96"."""
    groups: dict[str, list[int]] = {}
    for j, s in enumerate(plan.stages):
        groups.setdefault(_held_words(s.activations, s.activation_tier, s.kept_layers), []).append(j)
    parts = [f"{words} for stage{'s' if len(js) > 1 else ''} {fmt_spans(js)}" for words, js in groups.items()]
    return "activations: " + "; ".join(parts)


def _held_words(mode: str, tier: str, kept: tuple[int, ...]) -> str:
    """A stage's policy in words: keep on TIER, recompute (its input on TIER), selective (the layers kept)."""
    where = {"auto": "host", "peer": "a peer gpu"}.get(tier, tier)  # auto: the runtime's path, the input to the host
    if mode == "keep":
        return f"keep on {where}"
    if mode == "selective":
        return f"selective (layer{'s' if len(kept) > 1 else ''} {fmt_spans(list(kept))} kept), on {where}"
    return f"recompute, inputs on {where}"
