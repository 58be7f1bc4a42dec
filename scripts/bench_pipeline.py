"""Steady-state training throughput of the Mobius pipeline against plain PyTorch, as ratios measured in one run."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from benchlib import cpu_mark, cpu_model, markdown_table, other_share, torch_threads, torchrun_metrics
from torch import nn

from foundation.timing import Stopwatch
from mobiuspipe.config import RunConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import build_layers, lm_loss
from mobiuspipe.startup.config_plan import model_spec, plan_from_config

SIZES = {
    "tiny": {
        "model": {"num_blocks": 6, "d_model": 64, "num_heads": 4, "seq_len": 64},
        "data": {"batch_size": 8, "num_microbatches": 4},
    },
    "small": {
        "model": {"num_blocks": 8, "d_model": 256, "num_heads": 8, "seq_len": 128},
        "data": {"batch_size": 8, "num_microbatches": 4},
    },
}
"""The model sizes measured: the examples/tiny-gpt.yaml model and a wider, deeper one."""

ROWS = {
    "a": "plain PyTorch, 1 proc, 1 thread, full batch",
    "b": "plain PyTorch, 1 proc, 1 thread, 4 microbatches (grad accumulation)",
    "c": "plain PyTorch, 1 proc, 2 threads, full batch",
    "d": "mobiuspipe, 2 ranks x 1 thread, 4 stages, cross",
    "e": "mobiuspipe, 1 rank x 1 thread, 4 stages",
    "f": "as (d), bf16 weights and gradients (fp32 master)",
    "g": "torch.distributed.pipelining ScheduleLoopedBFS, 2 ranks x 1 thread, (d)'s cuts and mapping, all in memory",
    "h": "as (d), 512 MiB stand-ins (the peer's room: the plan keeps every activation)",
}
"""What each row of the table measures."""


@dataclass(frozen=True)
class Row:
    """One measured configuration: median steady-state step time and what the run reported."""

    size: str
    key: str
    step_s: float
    tokens: int
    last_loss: float
    split_s: tuple[float, float, float] | None = None
    """Median (compute, load, comm) seconds per step, largest over ranks; mobiuspipe rows only."""
    predicted_s: float | None = None
    """The planner's predicted step time (cost model, CPU stand-in); mobiuspipe rows only."""
    other_cpu: float = 0.0
    """Share of the machine's CPU time that other processes used while this row ran (0..1)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def run_dict(
    size: str, num_gpus: int, steps: int, out_dir: str | None = None, precision: str = "fp32", device_mb: float = 64.0
) -> dict:
    """The YAML-able run config of `size` on `num_gpus` ranks, 4 stages, 1 thread per rank, stand-ins of device_mb."""
    return {
        **SIZES[size],
        "train": {"steps": steps, "out_dir": out_dir, "log_every": steps, "precision": precision},
        "plan": {"num_gpus": num_gpus, "num_stages": 4, "mapping": "cross", "device_memory_mb": device_mb},
        "runtime": {"threads": 1},
    }


def steady(values: list[float], warmup: int) -> float:
    """Median of the values after the first `warmup`."""
    return statistics.median(values[warmup:])


def plain_run(cfg: RunConfig, threads: int, chunks: int) -> tuple[list[float], float]:
    """Step times of plain single-process AdamW training on `threads` threads, and the last loss.

    chunks=1 takes one full-batch gradient; chunks=M accumulates loss_i / M over M microbatches.
    """
    with torch_threads(threads):
        spec = model_spec(cfg)
        layers = build_layers(spec, cfg.train.seed)
        model = nn.Sequential(*(layers[l] for l in range(spec.num_layers)))
        t = cfg.train
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        times, loss = [], 0.0
        for step in range(t.steps):
            watch = Stopwatch()
            x, y = data.batch(step, cfg.data.batch_size)
            opt.zero_grad()
            loss = 0.0
            for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
                part = lm_loss(model(xi), yi) / chunks
                part.backward()
                loss += part.item()
            opt.step()
            times.append(watch.s)
        return times, loss


def tokens_per_step(cfg: RunConfig) -> int:
    """Tokens one optimizer step trains on: batch_size * seq_len."""
    return cfg.data.batch_size * cfg.model.seq_len


def pipeline_row(
    size: str, key: str, nproc: int, args: argparse.Namespace, tmp: Path, precision: str = "fp32", device_mb=64.0
) -> Row:
    """Measure mobiuspipe on `nproc` ranks (row `key`) in `precision` (fp32: the arithmetic of plain torch)."""
    folder = tmp / f"{size}-{key}"
    folder.mkdir()
    d = run_dict(size, nproc, args.steps, str(folder / "out"), precision, device_mb)
    recs = torchrun_metrics(d, nproc, folder, args.timeout)
    w = args.warmup
    compute, load, comm = (steady([r[k] for r in recs], w) for k in ("compute_s", "load_s", "comm_s"))
    split = (compute, load, comm)
    cfg = config_from_dict(d)
    return Row(
        size,
        key,
        steady([r["step_s"] for r in recs], w),
        tokens_per_step(cfg),
        recs[-1]["loss"],
        split,
        plan_from_config(cfg).predicted_step_time_s,
    )


def torch_pipelining_row(size: str, key: str, args: argparse.Namespace, tmp: Path) -> Row:
    """Measure torch.distributed.pipelining on 2 ranks (row `key`) with mobiuspipe's cuts
    (scripts/torch_pipelining_run.py)."""
    folder = tmp / f"{size}-{key}"
    folder.mkdir()
    d = run_dict(size, 2, args.steps)
    (folder / "run.yaml").write_text(yaml.safe_dump(d))
    script = Path(__file__).with_name("torch_pipelining_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    cmd += ["--config", str(folder / "run.yaml"), "--out", str(folder / "times.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    out = json.loads((folder / "times.json").read_text())
    return Row(size, key, steady(out["step_s"], args.warmup), tokens_per_step(config_from_dict(d)), out["losses"][-1])


def plain_row(size: str, key: str, cfg: RunConfig, threads: int, chunks: int, warmup: int) -> Row:
    """Measure plain PyTorch (row `key`) on `threads` threads with `chunks` microbatches."""
    times, loss = plain_run(cfg, threads, chunks)
    return Row(size, key, steady(times, warmup), tokens_per_step(cfg), loss)


def bench_size(size: str, args: argparse.Namespace, tmp: Path) -> list[Row]:
    """Rows (a)..(g) of one model size, measured one after the other, each with the others' CPU share."""
    cfg = config_from_dict(run_dict(size, 1, args.steps))
    m, w = cfg.data.num_microbatches, args.warmup
    assert m is not None, "the benchmark's configs fix data.num_microbatches"
    jobs = {
        "a": lambda: plain_row(size, "a", cfg, 1, 1, w),
        "b": lambda: plain_row(size, "b", cfg, 1, m, w),
        "c": lambda: plain_row(size, "c", cfg, 2, 1, w),
        "d": lambda: pipeline_row(size, "d", 2, args, tmp),
        "e": lambda: pipeline_row(size, "e", 1, args, tmp),
        "f": lambda: pipeline_row(size, "f", 2, args, tmp, "bf16"),
        "g": lambda: torch_pipelining_row(size, "g", args, tmp),
        "h": lambda: pipeline_row(size, "h", 2, args, tmp, device_mb=512.0),
    }
    rows = []
    for key, job in ((k, j) for k, j in jobs.items() if k in args.rows):
        mark = cpu_mark()
        row = job()
        rows.append(replace(row, other_cpu=other_share(mark)[0]))
        print(f"  {size} ({key}) {row.step_s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return rows


def cells(row: Row, ref: dict[str, Row]) -> list[str]:
    """The table cells of `row`; ratios are throughput relative to rows (a) and (c) of the same size."""
    a, c = ref[f"{row.size}/a"], ref[f"{row.size}/c"]
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    split = " / ".join(ms(s) for s in row.split_s) if row.split_s else "-"
    pred = f"{ms(row.predicted_s)} ({row.step_s / row.predicted_s:.2f}x)" if row.predicted_s else "-"
    return [
        row.size,
        f"({row.key}) {ROWS[row.key]}",
        ms(row.step_s),
        f"{row.tokens_per_s:,.0f}",
        f"{row.tokens_per_s / a.tokens_per_s:.2f}",
        f"{row.tokens_per_s / c.tokens_per_s:.2f}",
        split,
        pred,
        f"{row.last_loss:.3f}",
        f"{100 * row.other_cpu:.0f}%",
    ]


HEADER = [
    "size",
    "row",
    "step ms (median)",
    "tokens/s",
    "speed vs (a)",
    "speed vs (c)",
    "compute / load / comm ms",
    "predicted ms (measured/pred.)",
    "last loss",
    "other CPU",
]


def text_table(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(HEADER), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def machine() -> list[str]:
    """CPU model, cores, torch version, date and load average: where and when the figures were taken."""
    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine: {cpu}, {os.cpu_count()} cores, gpu {gpu}, {platform.system()} {platform.release()}",
        f"python {platform.python_version()}, torch {torch.__version__}",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --steps must leave at least one step after the warm-up."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each torchrun may take (default 300)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown for BENCHMARKS.md")
    p.add_argument(
        "--rows", nargs="+", choices=sorted(ROWS), default=sorted(ROWS), help="rows to measure (a and c always)"
    )
    args = p.parse_args(argv)
    args.rows = sorted({*args.rows, "a", "c"})  # the ratios' references
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure every row of every size, then print the machine and the table."""
    args = parse_args(argv)
    info = machine()
    rows: list[Row] = []
    mark = cpu_mark()
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for size in args.sizes:
            rows += bench_size(size, args, Path(tmp))
    share, wall = other_share(mark)
    info.append(
        f"other processes kept {100 * share:.1f}% of the {os.cpu_count()} cores busy during the "
        f"{wall:.0f} s run (column 'other CPU': near 0% = a quiet machine)"
    )
    ref = {f"{r.size}/{r.key}": r for r in rows}
    table = [cells(r, ref) for r in rows]
    print("\n".join(info))
    print(f"steps {args.steps} per run, median over the last {args.steps - args.warmup}\n")
    print(text_table(table))
    if args.markdown:
        print("\n" + markdown_table(HEADER, table))
    for size in args.sizes:
        g = ref.get(f"{size}/g")
        for key in ("d", "h"):
            if g and (ours := ref.get(f"{size}/{key}")):
                speed = g.step_s / ours.step_s
                print(f"{size}: mobiuspipe ({key}) steps at {speed:.2f}x the speed of torch.distributed.pipelining (g)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
