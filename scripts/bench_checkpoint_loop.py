"""What a checkpoint costs the training loop: the synchronous save_checkpoint against the loop's background
writer (Checkpointer: a snapshot, then a thread writes), on one Pipeline, in one run; states in host memory
(--tier host) or the optimizer's in the SSD store (--tier ssd, linked into the checkpoint)."""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_checkpoint import _config, _pipeline, _step
from benchlib import cpu_mark, cpu_model, markdown_table, other_share

from foundation.timing import Stopwatch
from mobiuspipe import checkpoint as ckpt
from mobiuspipe.config import MemoryConfig, TrainConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.run.checkpoints import Checkpointer

KEEP = 2


def block(pipe, data, s: int, steps: int, every: int, mode: str, root: Path) -> tuple[list[float], float]:
    """steps steps from step s with a checkpoint every `every` (mode sync / background / none): the loop's
    stall of each checkpoint and the block's wall seconds (the background writer's last commit included)."""
    writer = Checkpointer(
        TrainConfig(checkpoint_every=every, checkpoint_dir=str(root), keep_checkpoints=KEEP), pipe, ""
    )
    stalls = []
    with Stopwatch() as wall:
        try:
            for k in range(1, steps + 1):
                _step(pipe, data, s + k)
                if mode == "background":
                    waited = writer.after_step([writer.status()], stop=False)
                    stalls += [] if waited is None else [waited]
                elif mode == "sync" and k % every == 0:
                    with Stopwatch() as sw:
                        ckpt.save_checkpoint(pipe, root, KEEP)
                    stalls.append(sw.s)
            writer.finish()
        finally:
            writer.close()  # waits for the writer thread's last prune: the wall includes it
    return stalls, wall.s


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--tier", choices=["host", "ssd"], default="host")
    p.add_argument("--folder", default=str(Path(__file__).resolve().parents[1]))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix=".bench-ckpt-loop-", dir=args.folder))
    mem = None
    if args.tier == "ssd":  # as bench_checkpoint's ssd tier; the checkpoints on the same filesystem
        mem = MemoryConfig(optimizer="ssd", ssd_dir=str(work / "store"), host_budget_mb=256.0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mark = cpu_mark()
    modes = ["none", "sync", "background"]
    stalls: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    try:
        cfg = config_from_dict(_config(args))
        data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        with _pipeline(args, mem) as pipe:
            s = 0
            for _ in range(2):  # warm-up
                _step(pipe, data, s)
                s += 1
            for r in range(args.repeats):
                for m in modes[r % 3 :] + modes[: r % 3]:
                    got, wall = block(pipe, data, s, args.steps, args.every, m, work / m)
                    s += args.steps
                    stalls[m] += got
                    walls[m].append(wall)
                    print(f"  repeat {r + 1}: {m} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    none = statistics.median(walls["none"])
    rows = [
        [
            m,
            str(len(stalls[m])),
            f"{statistics.mean(stalls[m]):.3f}" if stalls[m] else "-",
            f"{statistics.median(walls[m]):.2f}",
            f"{statistics.median(walls[m]) / none:.3f}",
        ]
        for m in modes
    ]
    head = ["checkpoints", "count", "mean loop stall s", f"median s per {args.steps} steps", "x none"]
    share, seconds = other_share(mark)
    print(f"command: {' '.join(['python', *sys.argv])}; date: {date}; machine: {cpu_model()}")
    print(f"other processes kept {share:.0%} of the cores busy during the {seconds:.0f} s run")
    print(markdown_table(head, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
