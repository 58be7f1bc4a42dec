"""The device ledger's cost in a keep step against its floor, the same run with the ledger doing nothing.

Usage: PYTHONPATH=. .venv/bin/python scripts/bench_ledger.py [--rounds 3] [--steps 12] [--blocks 6]

One rank, the tiny GPT (d_model 64, 4 heads, seq 64, 8 sequences in 4 microbatches, 4 stages, fp32, 1 thread)
trained with every stage under keep (each saved tensor of a kept forward is held in the ledger). A round trains
`steps` steps with the real ledger, then the same steps with DeviceLedger.hold, drop and drop_kind made no-ops
(the floor: no accounting); the figure is the compute per step after the first, the median over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
from benchlib import cpu_model

from mobiuspipe.config import config_from_dict
from mobiuspipe.memory.ledger import DeviceLedger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "mobiuspipe"))
import activation_runs  # pyright: ignore[reportMissingImports]  # the tests' GPT runner, on the path above


def compute_per_step(cfg, steps: int) -> float:
    run = activation_runs.run(cfg, "keep", steps=steps, p=0.0)
    return run.compute_s / (steps - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = config_from_dict(
        {
            "model": {"num_blocks": args.blocks, "d_model": 64, "num_heads": 4, "seq_len": 64, "vocab_size": 256},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "train": {"steps": args.steps, "precision": "fp32"},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )
    real = (DeviceLedger.hold, DeviceLedger.drop, DeviceLedger.drop_kind)
    noop = (lambda self, key, t: None, lambda self, key: None, lambda self, kind: None)
    compute_per_step(cfg, 3)  # warm-up
    with_ledger, floor = [], []
    for _ in range(args.rounds):
        DeviceLedger.hold, DeviceLedger.drop, DeviceLedger.drop_kind = real
        with_ledger.append(compute_per_step(cfg, args.steps))
        DeviceLedger.hold, DeviceLedger.drop, DeviceLedger.drop_kind = noop
        floor.append(compute_per_step(cfg, args.steps))
    DeviceLedger.hold, DeviceLedger.drop, DeviceLedger.drop_kind = real
    a, b = statistics.median(with_ledger), statistics.median(floor)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench_ledger {now:%Y-%m-%d %H:%M} UTC, {cpu_model()}, torch {torch.__version__}")
    print(f"keep step compute: with the ledger {a * 1e3:.2f} ms, ledger a no-op {b * 1e3:.2f} ms: {a / b:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
