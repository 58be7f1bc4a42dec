"""Checkpoint cost in one run: step time with save_checkpoint every N steps against none; write rate against fio."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from bench_probe import disk
from benchlib import cpu_mark, cpu_model, fio_gbps, markdown_table, other_share

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe import Pipeline, _ext
from mobiuspipe import checkpoint as ckpt
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

REPO = Path(__file__).resolve().parents[1]
KEEP = 2  # train.keep_checkpoints' default: from the third checkpoint on, each one also removes the oldest
FIO = ["--ioengine=psync", "--iodepth=1", "--fallocate=none", "--direct=0", "--end_fsync=1"]  # --direct=0 wins
PARTS = ("export", "save_file", "fsync", "fsync links", "checksum", "commit", "prune")
WHAT_PARTS = {
    "export": "stage.states.export_state: a clone of the host states; on the ssd tier, hard links of the store's "
    "record files into rank0/stage{j}/ (no bytes copied)",
    "save_file": "safetensors.torch.save_file: header + buffered writes of every tensor (page cache)",
    "fsync": "os.fsync of rank0.safetensors: the page cache to the disk",
    "fsync links": "os.fsync of the linked record files and their folders (ssd tier)",
    "checksum": "checkpoint._digest: crc32c (mobiuspipe's, 3 streams) of rank0.safetensors, re-read from the "
    "page cache",
    "commit": "`complete` (write, fsync, rename), fsync of the folder, rename to step-N, fsync of the root",
    "prune": "rmtree of the checkpoints beyond keep=2",
}


def _config(args: argparse.Namespace) -> dict:
    return {
        "model": {"num_blocks": args.blocks, "d_model": args.d_model, "num_heads": args.d_model // 64, "seq_len": 64},
        "data": {"batch_size": 4, "num_microbatches": 4},
        "train": {"lr": 1e-4, "precision": "fp32", "seed": 1},
        "plan": {"num_gpus": 1, "num_stages": args.stages, "device_memory_mb": 512},
    }


def _pipeline(args: argparse.Namespace, memory: MemoryConfig | None) -> Pipeline:
    cfg = config_from_dict(_config(args))
    layers = layer_factories(model_spec(cfg), 1)
    opt = partial(CPUAdam, lr=1e-4)
    return Pipeline(layers, lm_loss, plan=plan_for_config(cfg), optimizer=opt, memory=memory)


def _timed(fn: Callable, into: dict, name: str, when: Callable[..., bool] = lambda *a: True) -> Callable:
    def wrapper(*a, **kw):
        if not when(*a):
            return fn(*a, **kw)
        with Stopwatch() as sw:
            out = fn(*a, **kw)
        into[name] += sw.s
        return out

    return wrapper


@contextmanager
def instrumented(pipe: Pipeline, parts: dict) -> Iterator[None]:
    """save_checkpoint's steps timed into parts (seconds summed over calls) by wrapping what it calls: the
    module's own functions and each stage's export_state. Undone at exit; mobiuspipe's code is unchanged."""
    names = {"save_file": "save_file", "_digest": "checksum", "_commit": "commit", "prune": "prune"}
    old = {k: getattr(ckpt, k) for k in [*names, "fsync_path"]}
    for k, part in names.items():
        setattr(ckpt, k, _timed(old[k], parts, part))
    fsync = _timed(old["fsync_path"], parts, "fsync", lambda path: Path(path).suffix == ".safetensors")
    ckpt.fsync_path = _timed(fsync, parts, "fsync links", _linked)
    for stage in pipe.engine.stages.values():
        stage.states.export_state = _timed(stage.states.export_state, parts, "export")
    try:
        yield
    finally:
        for k, fn in old.items():
            setattr(ckpt, k, fn)
        for stage in pipe.engine.stages.values():
            del stage.states.export_state


def _linked(path) -> bool:
    """A linked record file (CHECKPOINT/rank{r}/stage{j}/FILE) or its folder (CHECKPOINT/rank{r}/stage{j})."""
    p = Path(path)
    return any(re.fullmatch(r"rank\d+", q.name) for q in (p.parent, p.parent.parent))


def _step(pipe: Pipeline, data, s: int) -> float:
    """Seconds of one step, its host updates included (as in bench_tiers: the next step needs them)."""
    with Stopwatch() as sw:
        pipe.train_batch(*data.batch(s, 4))
        pipe.engine.wait_updates()
    return sw.s


def _save(pipe: Pipeline, root: Path, parts: dict) -> tuple[float, tuple[int, int]]:
    """(seconds of one save_checkpoint, (bytes of every file of the folder it committed, bytes of those among
    them that it wrote: all but the hard-linked records))."""
    with instrumented(pipe, parts), Stopwatch() as sw:
        folder = ckpt.save_checkpoint(pipe, root, KEEP)
    files = [f for f in folder.rglob("*") if f.is_file()]
    return sw.s, (sum(f.stat().st_size for f in files), sum(f.stat().st_size for f in files if f.parent == folder))


def _fio(work: Path, nbytes: int) -> float:
    """GB/s of fio writing a new file of nbytes (MiB rounded up) in work: buffered, then fsync, as save_file."""
    path = work / "fio.bin"
    path.unlink(missing_ok=True)
    try:
        return fio_gbps(path, "write", -(-nbytes // MiB), FIO)
    finally:
        path.unlink(missing_ok=True)


def bench_tier(args, memory: MemoryConfig | None, work: Path, every: list[int]) -> tuple[dict, list[float]]:
    """One Pipeline; per variant (0 = no checkpoints, else every N steps) its step seconds, checkpoint seconds,
    bytes and parts, over --repeats blocks of --steps steps each, the order of the variants rotated per repeat;
    and fio's GB/s once per repeat (the size of the checkpoint, same folder)."""
    cfg = config_from_dict(_config(args))
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    variants = [0, *every]
    out: dict = {v: {"steps": [], "saves": [], "bytes": (0, 0), "parts": defaultdict(float)} for v in variants}
    root, fio, s = work / "checkpoints", [], 0
    with _pipeline(args, memory) as pipe:
        for _ in range(2):  # warm-up: shapes learned, buffers touched, one checkpoint's paths taken
            _step(pipe, data, s)
            s += 1
        _save(pipe, root, defaultdict(float))
        for r in range(args.repeats):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                row = out[v]
                for k in range(1, args.steps + 1):
                    row["steps"].append(_step(pipe, data, s))
                    s += 1
                    if v and k % v == 0:
                        seconds, row["bytes"] = _save(pipe, root, row["parts"])
                        row["saves"].append(seconds)
                print(f"  repeat {r + 1}: {_name(v)} done", file=sys.stderr, flush=True)
            fio.append(_fio(work, max(o["bytes"][0] for o in out.values())))
        out["params"] = sum(st.numel for st in pipe.engine.stages.values())
    return out, fio


def _name(v: int) -> str:
    return f"every {v}" if v else "none"


def hash_costs(nbytes: int) -> dict[str, float]:
    """Median seconds (of 3) to crc32c (mobiuspipe's, 3 streams, the checkpoint's checksum) and to sha256 (the
    one before) nbytes already in memory: what the checksum costs without re-reading the file."""
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    runs: dict[str, list[float]] = {"sha256": [], "crc32c": []}
    for _ in range(3):
        with Stopwatch() as sha:
            hashlib.sha256(buf.numpy().data).hexdigest()  # the buffer itself, not a copy
        with Stopwatch() as crc:
            _ext.C.crc32c(buf)
        runs["sha256"].append(sha.s)
        runs["crc32c"].append(crc.s)
    return {k: statistics.median(v) for k, v in runs.items()}


HEAD1 = ["tier", "variant", "steps", "median step s", "checkpoints", "mean checkpoint s", "s per step", "x none"]
HEAD1 += ["x none, checkpoints only"]
HEAD2 = ["tier", "checkpoint MB", "written MB", "mean checkpoint s", "GB/s", "fio GB/s (median)", "x fio", "floor s"]
HEAD2 += ["x floor"]


def step_rows(tier: str, out: dict, every: list[int]) -> list[list[str]]:
    """Table 1: s per step = median step + mean checkpoint / N; x none = that / the none variant's median step;
    checkpoints only = (the none variant's median step + mean checkpoint / N) / the same, which leaves out the
    (on a busy machine mostly random) difference between the variants' median steps."""
    base = statistics.median(out[0]["steps"])
    rows = []
    for v in [0, *every]:
        o = out[v]
        med = statistics.median(o["steps"])
        mean_ck = statistics.mean(o["saves"]) if o["saves"] else 0.0
        per = med + (mean_ck / v if v else 0.0)
        ck = f"{mean_ck:.3f}" if v else "-"
        rows.append([tier, _name(v), str(len(o["steps"])), f"{med:.3f}", str(len(o["saves"])), ck, f"{per:.3f}"])
        rows[-1] += [f"{per / base:.3f}", f"{(base + (mean_ck / v if v else 0.0)) / base:.3f}"]
    return rows


def rate_row(tier: str, out: dict, every: list[int], fio: list[float]) -> tuple[list[str], list[str]]:
    """Table 2 (the rate against fio and the floor: of every byte in the checkpoint, linked ones included) and
    table 3 (where the checkpoint's seconds go)."""
    saves = [t for v in every for t in out[v]["saves"]]
    nbytes, written = out[every[0]]["bytes"]
    mean_s, gbps = statistics.mean(saves), statistics.median(fio)
    floor = nbytes / (gbps * 1e9)
    rate = nbytes / mean_s / 1e9
    row2 = [tier, f"{nbytes / 1e6:.0f}", f"{written / 1e6:.3f}", f"{mean_s:.3f}", f"{rate:.3f}", f"{gbps:.3f}"]
    row2 += [f"{rate / gbps:.2f}", f"{floor:.3f}", f"{mean_s / floor:.2f}"]
    parts = {p: sum(out[v]["parts"][p] for v in every) / len(saves) for p in PARTS}
    other = mean_s - sum(parts.values())
    row3 = [tier] + [f"{t:.3f} ({t / mean_s:.0%})" for t in [*parts.values(), other]]
    return row2, row3


def section(args, info: list[str], tables: list[list[list[str]]], results: dict, hashes: dict) -> str:
    """The run as Markdown: the machine and command, the three tables, what the checksum costs and what each part
    is; under a heading and with the machine in a code block for BENCHMARKS.md with --markdown."""
    out, _ = results[args.tiers[0]]
    nbytes, saves = out[args.every[0]]["bytes"][1], sum(len(out[v]["saves"]) for v in args.every)
    in_ckpt = sum(out[v]["parts"]["checksum"] for v in args.every) / saves
    side = (
        f"crc32c of rank0.safetensors inside the checkpoint ({args.tiers[0]}, {nbytes / 1e6:.0f} MB, re-read from the "
        f"page cache): {in_ckpt:.3f} s; of the same bytes already in memory (median of 3): {hashes['crc32c']:.3f} s; "
        f"sha256 (the checksum before crc32c) of them: {hashes['sha256']:.3f} s"
    )
    what = "\n".join(f"- {p}: {w}" for p, w in WHAT_PARTS.items())
    heads = [HEAD1, HEAD2, ["tier", *PARTS, "other"]]
    body = "\n\n".join(markdown_table(h, t) for h, t in zip(heads, tables)) + f"\n\n{side}.\n\n{what}"
    if not args.markdown:
        return "\n".join(info) + "\n\n" + body
    return "## Checkpoint cost (`scripts/bench_checkpoint.py`)\n\n```\n" + "\n".join(info) + "\n```\n\n" + body


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--folder", type=Path, default=REPO, help="where the checkpoints, the SSD tier and fio write "
                   f"(a temp folder inside it, removed after; default {REPO})")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="steps per variant per repeat (default 10)")
    p.add_argument("--every", default="5,10", help="checkpoint intervals N, comma-separated (default 5,10)")
    p.add_argument("--repeats", type=int, default=2, help="blocks per variant, order rotated (default 2)")
    p.add_argument("--tiers", default="host,ssd", help="host (every state in memory) and/or ssd (memory.optimizer)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--markdown", action="store_true", help="print the run as its section for BENCHMARKS.md")
    args = p.parse_args(argv)
    args.every = [int(n) for n in args.every.split(",")]
    args.tiers = args.tiers.split(",")
    if min(args.every) < 1 or args.steps < max(args.every) or args.repeats < 1:
        p.error(f"--every must be >= 1 and <= --steps ({args.steps}), --repeats >= 1; found {args.every}")
    if not set(args.tiers) <= {"host", "ssd"} or not args.folder.is_dir():
        p.error(f"--tiers takes host and ssd, --folder an existing folder; found {args.tiers}, {args.folder}")
    return args


def run(args: argparse.Namespace) -> tuple[dict, dict]:
    """Every tier in a temporary folder inside --folder (removed at the end, also on error or SIGTERM)."""
    results, hashes = {}, {}
    work = Path(tempfile.mkdtemp(prefix=".bench-ckpt-", dir=args.folder))
    try:
        for tier in args.tiers:
            mem = None
            if tier == "ssd":
                mem = MemoryConfig(optimizer="ssd", ssd_dir=str(work / "store"), host_budget_mb=256.0)
            print(f"tier {tier}:", file=sys.stderr, flush=True)
            (work / tier).mkdir()
            results[tier] = bench_tier(args, mem, work / tier, args.every)
            shutil.rmtree(work / tier)
            shutil.rmtree(work / "store", ignore_errors=True)
        hashes = hash_costs(results[args.tiers[0]][0][args.every[0]]["bytes"][1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results, hashes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so the folder is removed
    torch.set_num_threads(1)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = [
        f"command: {shlex.join(['python', *sys.argv])}",
        f"date: {date}; machine: {cpu_model()}, {os.cpu_count()} cores; torch threads 1",
        disk(args.folder.resolve()),
    ]
    mark = cpu_mark()
    results, hashes = run(args)
    share, wall = other_share(mark)
    params = next(iter(results.values()))[0]["params"]
    info += [
        f"other processes kept {share:.0%} of the cores busy during the {wall:.0f} s run",
        f"GPT {args.blocks}x{args.d_model}, {params / 1e6:.1f}M parameters, {args.stages} stages, one rank, fp32, "
        f"batch 4 x seq 64 in 4 microbatches; {args.repeats} repeats x {args.steps} steps per variant, order rotated",
        f"fio: {' '.join(FIO)} --bs=1M, a new file of the checkpoint's size, once per repeat",
    ]
    t1 = [r for tier, (out, _) in results.items() for r in step_rows(tier, out, args.every)]
    t23 = [rate_row(tier, out, args.every, fio) for tier, (out, fio) in results.items()]
    print(section(args, info, [t1, [a for a, _ in t23], [b for _, b in t23]], results, hashes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
