"""The torchrun entry: `torchrun --nproc_per_node N -m mobiuspipe.train --config FILE.yaml`.

Each rank is one gpu of the plan: the built-in GPT goes through the public Pipeline (mobiuspipe.pipeline),
which builds only this rank's stages, keeps their weights in the host tier and runs its schedule every
step; rank 0 reports. Errors a user can fix print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from foundation.errors import UserError
from foundation.timing import Stopwatch
from foundation.units import fmt_bytes
from mobiuspipe.config import RunConfig, load_config
from mobiuspipe.config_plan import gpt_spec, plan_for_config
from mobiuspipe.dataset import PackedTokens, open_data, open_eval
from mobiuspipe.metrics import Reporter, StepMetrics, device_peak_line
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.ranks import gather_all
from partition.costmodel import ARENA_SLOTS
from partition.device_peak import planned_device_bytes
from partition.plan import Plan, save_plan

__all__ = ["main", "train"]


def train(cfg: RunConfig) -> None:
    """Train the config's GPT for cfg.train.steps steps as this rank of the job (the group must not exist yet)."""
    torch.set_num_threads(cfg.runtime.threads)
    t = cfg.train
    optimizer = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)  # before the group exists:
    open_eval(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)  # bad data stops every rank alike
    plan = plan_for_config(cfg)
    with Pipeline(
        layer_factories(gpt_spec(cfg), t.seed),
        lm_loss,
        plan=plan,
        optimizer=optimizer,
        num_microbatches=cfg.data.num_microbatches,
        precision=t.precision,
        memory=cfg.memory,
        comm_timeout_s=cfg.runtime.comm_timeout_s,
    ) as pipe:
        _training_loop(cfg, pipe, data)


def _training_loop(cfg: RunConfig, pipe: Pipeline, data: PackedTokens) -> None:
    """Every step on this rank; rank 0 reports and writes out_dir; every rank writes its stages' weights."""
    rank, plan = pipe.rank, pipe.plan
    out = Path(cfg.train.out_dir) if cfg.train.out_dir else None
    report = Reporter(
        cfg.train.steps, cfg.train.log_every, str(out) if out and rank == 0 else None, sys.stdout if rank == 0 else None
    )
    if rank == 0:
        print(f"{_banner(cfg, plan)}; {_states_line(cfg, pipe.state_tiers)}; data: {data.describe()}", flush=True)
    if out and rank == 0:
        (out / "config.yaml").write_text(cfg.to_yaml())
        save_plan(plan, out / "plan.yaml")
    tokens = cfg.data.batch_size * cfg.model.seq_len
    for step in range(cfg.train.steps):
        sw = Stopwatch()
        x, y = data.batch(step, cfg.data.batch_size)
        lr = cfg.train.lr_of(step)
        pipe.set_lr(lr)
        r = pipe.train_batch(x, y)
        report(
            StepMetrics(
                step,
                r.loss,
                tokens / sw.s,
                sw.s,
                r.times.compute_s,
                r.times.load_s,
                r.times.comm_s,
                r.arena_peak_bytes,
                r.arena_budget_bytes,
                r.loss_scale,
                r.skipped,
                r.device_peak_bytes,
                lr,
            )
        )
    _report_device_peak(pipe)
    report.close()
    if out:
        _save_weights(pipe, out / "weights")


def _report_device_peak(pipe: Pipeline) -> None:
    """Every rank sends its measured device peak over the run (and what its ledger held then); rank 0 prints
    them against the plan's figure per gpu in one line."""
    peak = pipe.engine.peak
    every = gather_all(pipe.info, (peak.run_bytes, peak.run_parts))
    if pipe.rank == 0:
        measured = [b for b, _ in every]
        parts = max(every, key=lambda e: e[0])[1]
        print(device_peak_line(measured, planned_device_bytes(pipe.plan), peak.source, parts), flush=True)


def _banner(cfg: RunConfig, plan: Plan) -> str:
    source = f"from {cfg.plan.file}" if cfg.plan.file else "made at start-up"
    return (
        f"mobiuspipe: {plan.model}, {plan.num_layers} layers in {plan.num_stages} stages on {plan.num_gpus} "
        f"ranks (stage -> rank {plan.mapping}, {plan.mapping_rule} mapping; plan {source}); "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size}; {plan.dtype} weights, fp32 master; "
        f"device arena "
        f"{fmt_bytes(plan.arena_bytes)} per rank ({ARENA_SLOTS} slots of {fmt_bytes(plan.slot_bytes)})"
    )


def _states_line(cfg: RunConfig, tiers: dict[int, tuple[str, str]]) -> str:
    """Where each stage's optimizer states and weights went, e.g. "optimizer states (auto): host for stages
    1, 2, 3; ssd for stage 0; weights (host): host for stages 0, 1, 2, 3 (under /nvme/run, 1024 MiB host
    budget per rank)"."""
    mem = cfg.memory
    line = "; ".join(
        f"{what} ({mode}): {_by_tier({j: t[k] for j, t in tiers.items()})}"
        for k, (what, mode) in enumerate((("optimizer states", mem.optimizer), ("weights", mem.weights)))
    )
    on_ssd = any("ssd" in t for t in tiers.values())
    return line + (f" (under {mem.ssd_dir}, {mem.host_budget_mb:g} MiB host budget per rank)" if on_ssd else "")


def _by_tier(tiers: dict[int, str]) -> str:
    parts = []
    for tier in ("host", "ssd"):
        stages = sorted(j for j, t in tiers.items() if t == tier)
        if stages:
            parts.append(f"{tier} for stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}")
    return "; ".join(parts)


def _save_weights(pipe: Pipeline, folder: Path) -> None:
    """Each rank writes its stages' weights: weights/stage{j}.pt, a dict "layer.param" -> tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    for j, weights in pipe.stage_state_dicts().items():
        tmp = folder / f".stage{j}.pt.tmp"
        torch.save(weights, tmp)
        tmp.replace(folder / f"stage{j}.pt")


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mobiuspipe.train", description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    args = p.parse_args(argv)
    try:
        train(load_config(args.config))
    except UserError as e:
        print(f"mobiuspipe.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
