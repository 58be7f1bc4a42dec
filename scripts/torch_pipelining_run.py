"""The peer of bench_pipeline's row (g): the run config's GPT trained by torch.distributed.pipelining under torchrun
(gloo, one thread a rank), cut where mobiuspipe's plan for the same config cuts it, stage j on rank j mod ranks (the
cross mapping of 2 ranks), ScheduleLoopedBFS over the config's microbatches, every weight, gradient and activation in
memory, and torch's AdamW on each rank after the step. Rank 0 writes each step's seconds and rank `ranks - 1` the
losses to --out (JSON).

  torchrun --nproc_per_node 2 scripts/torch_pipelining_run.py --config run.yaml --out times.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS

from mobiuspipe.config import load_config
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import build_layers, lm_loss
from mobiuspipe.startup.config_plan import model_spec, plan_from_config


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cfg = load_config(args.config)
    plan = plan_from_config(cfg)
    spec, t = model_spec(cfg), cfg.train
    layers = build_layers(spec, t.seed)
    mine = [j for j in range(len(plan.stages)) if j % ranks == rank]
    stages = [
        PipelineStage(
            nn.Sequential(*(layers[l] for l in range(plan.stages[j].first, plan.stages[j].last + 1))),
            j,
            len(plan.stages),
            torch.device("cpu"),
        )
        for j in mine
    ]
    schedule = ScheduleLoopedBFS([*stages], plan.num_microbatches, loss_fn=lm_loss)  # a list of the base type
    params = [q for s in stages for q in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    times, losses = [], []
    for step in range(t.steps):
        x, y = data.batch(step, cfg.data.batch_size)
        start = time.perf_counter()
        opt.zero_grad()
        got: list[torch.Tensor] = []
        inputs = (x,) if 0 in mine else ()
        last = len(plan.stages) - 1 in mine
        schedule.step(*inputs, target=y if last else None, losses=got if last else None)
        opt.step()
        dist.barrier()  # the step ends when every rank's has
        times.append(time.perf_counter() - start)
        if last:
            losses.append(float(torch.stack(got).mean()))
    out = {"step_s": times, "losses": losses, "cuts": [[s.first, s.last] for s in plan.stages]}
    gathered: list[dict | None] = [None] * ranks
    dist.all_gather_object(gathered, out)
    if rank == 0:
        merged = {"step_s": times, "losses": next(g["losses"] for g in gathered if g and g["losses"])}
        Path(args.out).write_text(json.dumps({**merged, "cuts": out["cuts"]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
