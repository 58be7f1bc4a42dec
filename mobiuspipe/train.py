"""The torchrun entry: `torchrun --nproc_per_node N -m mobiuspipe.train --config FILE.yaml`.

Each rank is one gpu of the plan: it builds only its stages' layers, keeps their weights in the host
tier, and runs its schedule every step; rank 0 reports. Errors a user can fix print one line and exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from foundation.errors import UserError
from foundation.units import fmt_bytes
from mobiuspipe.comm import Comm
from mobiuspipe.config import RunConfig, load_config
from mobiuspipe.dataset import ByteData
from mobiuspipe.device import Device
from mobiuspipe.engine import Engine
from mobiuspipe.errors import WorldSizeError
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.metrics import Reporter, StepMetrics
from mobiuspipe.optim import CPUAdam
from mobiuspipe.models.gpt import build_layers
from mobiuspipe.planning import model_spec, plan_for_run
from mobiuspipe.schedule import build_schedule, check_schedules
from mobiuspipe.stage import Stage
from partition.costmodel import ARENA_SLOTS
from partition.plan import Plan, save_plan

__all__ = ["main"]


def _rank_env() -> tuple[int, int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except KeyError as e:
        raise WorldSizeError(f"{e.args[0]} is not set: start training with `torchrun --nproc_per_node N -m "
                             f"mobiuspipe.train --config FILE.yaml` (or `mobiuspipe train --config FILE.yaml`)") from e


def _build_stages(cfg: RunConfig, plan: Plan, rank: int, device: Device) -> dict[int, Stage]:
    spec = model_spec(cfg)
    mine = plan.stages_of(rank)
    layers = build_layers(spec, cfg.train.seed, [l for j in mine for l in range(plan.stages[j].first,
                                                                             plan.stages[j].last + 1)])
    t = cfg.train

    def make_optimizer(params):
        return CPUAdam(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)

    return {j: Stage(j, {l: layers[l] for l in range(plan.stages[j].first, plan.stages[j].last + 1)}, device,
                     make_optimizer) for j in mine}


def _engine(cfg: RunConfig, plan: Plan, rank: int, local_rank: int) -> Engine:
    device = Device(local_rank)
    m = plan.num_microbatches
    schedules = [build_schedule(plan.mapping, g, m) for g in range(plan.num_gpus)]
    check_schedules(plan.mapping, m, schedules)
    arena = DeviceArena(plan.slot_bytes, ARENA_SLOTS, device.torch_device)
    act_shape = (cfg.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    return Engine(plan.mapping, rank, _build_stages(cfg, plan, rank, device), schedules[rank], device, arena,
                  Comm(rank, cfg.runtime.comm_timeout_s), act_shape, m)


def _check_same_plan(plan: Plan, rank: int) -> None:
    """Every rank must follow the same plan (each made or read its own): compare digests before any work."""
    what = {k: v for k, v in plan.to_dict().items() if k != "solver"}  # the solver's wall time differs
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise WorldSizeError(f"rank {rank}: ranks {differ} follow a different plan than rank 0 (different plan "
                             f"files, configs or code versions); give every rank the same plan.file")


def _reduce(engine: Engine, values: list[float], op, what: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=engine.device.torch_device)
    return engine.comm.all_reduce(t, op, what).tolist()


def train(cfg: RunConfig) -> None:
    """Run cfg.train.steps steps on this rank (the process group must not exist yet)."""
    rank, world, local_rank = _rank_env()
    torch.set_num_threads(cfg.runtime.threads)
    plan = plan_for_run(cfg)
    if plan.num_gpus != world:
        raise WorldSizeError(f"the plan has {plan.num_gpus} gpus but torchrun started {world} ranks: run "
                             f"`torchrun --nproc_per_node {plan.num_gpus} ...` or re-plan for {world} gpus")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before any collective: NCCL uses the current device
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.runtime.comm_timeout_s))
    try:
        _check_same_plan(plan, rank)
        _run(cfg, plan, rank, local_rank)
    finally:
        dist.destroy_process_group()


def _run(cfg: RunConfig, plan: Plan, rank: int, local_rank: int) -> None:
    engine = _engine(cfg, plan, rank, local_rank)
    data = ByteData(cfg.data.text_path, cfg.model.seq_len, cfg.train.seed)
    out = Path(cfg.train.out_dir) if cfg.train.out_dir else None
    report = Reporter(cfg.train.steps, cfg.train.log_every, str(out) if out and rank == 0 else None,
                      sys.stdout if rank == 0 else None)
    if rank == 0:
        print(_banner(cfg, plan), flush=True)
    if out and rank == 0:
        (out / "config.yaml").write_text(cfg.to_yaml())
        save_plan(plan, out / "plan.yaml")
    tokens = cfg.data.batch_size * cfg.model.seq_len
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        x, y = data.batch(step, cfg.data.batch_size)
        engine.arena.reset_peak()
        loss, times = engine.run_step(step, x, y)
        (loss,) = _reduce(engine, [loss], dist.ReduceOp.SUM, f"the loss of step {step}")
        c, l, m, peak = _reduce(engine, [times.compute_s, times.load_s, times.comm_s, engine.arena.peak_bytes],
                                dist.ReduceOp.MAX, f"the metrics of step {step}")
        dt = time.perf_counter() - t0
        report(StepMetrics(step, loss, tokens / dt, dt, c, l, m, int(peak), engine.arena.budget_bytes))
    engine.finish()
    report.close()
    if out:
        _save_weights(engine, out / "weights")


def _banner(cfg: RunConfig, plan: Plan) -> str:
    source = f"from {cfg.plan.file}" if cfg.plan.file else "made at start-up"
    return (f"mobiuspipe: {plan.model}, {plan.num_layers} layers in {plan.num_stages} stages on {plan.num_gpus} "
            f"ranks (stage -> rank {plan.mapping}, {plan.mapping_rule} mapping; plan {source}); "
            f"{plan.num_microbatches} microbatches of {plan.microbatch_size}; device arena "
            f"{fmt_bytes(plan.arena_bytes)} per rank ({ARENA_SLOTS} slots of {fmt_bytes(plan.slot_bytes)})")


def _save_weights(engine: Engine, folder: Path) -> None:
    """Each rank writes its stages' master weights: weights/stage{j}.pt, a dict "layer.param" -> tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    for j, stage in engine.stages.items():
        tmp = folder / f".stage{j}.pt.tmp"
        torch.save(stage.state_dict(), tmp)
        tmp.replace(folder / f"stage{j}.pt")


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mobiuspipe.train", description=__doc__.splitlines()[0])
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
