"""One rank of the 2-rank activation test (run by torchrun): every mode of activation_runs, results to a file."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import activation_runs as runs
import torch
import torch.distributed as dist

from mobiuspipe.startup.config_plan import plan_for_config


def main(precision: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # each Pipeline joins this group
    runs.rotate_slots()
    cfg = runs.config(num_gpus=2, precision=precision)
    results = {}
    for name, activations in runs.choices(plan_for_config(cfg)).items():
        r = runs.run(cfg, activations)
        results[name] = {"losses": r.losses, "weights": r.weights, "peaks": r.peaks}
    torch.save(results, out / f"rank{os.environ['RANK']}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
