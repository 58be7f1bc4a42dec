"""Step time with every state on SSD against its floor, the overlap of the updates with the backward, and bf16 vs
fp32, measured in one run on one rank (a CPU stand-in) of a GPT cut into several stages.

Rows (median step time over --steps steps after one warm-up step; the fp32 rows are Pipelines alive at
once, stepped in turn, so that the machine's drift touches them alike; bf16 then alone, 2 steps):
  host fp32 / host bf16   every state in host memory: the compute of the step (the yardstick), and bf16's cost
  ssd                     memory.optimizer and memory.weights ssd under --budget-mb: the updates overlap the
                          backward of earlier stages
  ssd serialized          the same with overlap_updates=False: every update after the backward
  ssd clip, ...           (--clip) the ssd row with max_grad_norm: never triggering, with the speculative update
                          and with the updates held for the norm; and triggering every step (all rolled back)
  host clip, speculative  (--clip) host fp32 with clipping that never triggers: what keeping the overwritten
                          states costs
  ssd delayed             (--delayed) the ssd row with the delayed update (Pipeline(delayed_update=0)): each
                          step's updates run under the next step; alone after the others, its steps timed without
                          waiting for the updates (the next step waits for what it needs)
The floor of the ssd step is max(host fp32 step, the I/O floor), where the I/O floor is the largest of three
lower bounds measured by fio on the same disk with the engine's kind of buffer pages: reading the step's R
bytes, writing its W bytes, and reading and writing min(R, W) bytes at once. R and W are what the ssd step
moved (/proc/self/io). Bar (issue 10): ssd <= 1.2x its floor; the overlap gain is serialized / ssd
(Fuyou reports 1.09-1.38x). Bar (issue 27): the gain with clipping within 5% of the gain without.

  .venv/bin/python scripts/bench_tiers.py --ssd-dir /path/on/nvme [--clip] [--delayed]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch
from benchlib import buffer_kind, fio_buffers, fio_rw, markdown_table

from foundation.timing import Stopwatch
from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.states import SsdStreamStates
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

MiB = 1 << 20

CLIP_ROWS = {
    "ssd clip, speculative": {"max_grad_norm": 1e9, "speculative_update": True},
    "ssd clip, held": {"max_grad_norm": 1e9, "speculative_update": False},
    "ssd clip, all clipped": {"max_grad_norm": 1e-9, "speculative_update": True},
}
"""--clip's rows: clipping that never triggers (the speculative updates stand), the same with every update held for
the norm (before the speculative update), and clipping that triggers every step (every update rolled back and
redone after the backward: the worst case)."""


def _io_bytes() -> tuple[int, int]:
    """Bytes this process has read from and written to storage so far (/proc/self/io)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _config(args: argparse.Namespace, precision: str) -> dict:
    return {
        "model": {"num_blocks": args.blocks, "d_model": args.d_model, "num_heads": args.d_model // 64, "seq_len": 64},
        "data": {"batch_size": 4, "num_microbatches": 4},
        "train": {"lr": 1e-4, "precision": precision, "seed": 1},
        "plan": {"num_gpus": 1, "num_stages": args.stages, "device_memory_mb": args.device_mb},
    }


def _pipeline(
    args: argparse.Namespace, precision: str, memory: MemoryConfig | None, overlap: bool, clip: dict | None = None
) -> Pipeline:
    """clip: Pipeline's max_grad_norm and speculative_update, for the clipping rows."""
    cfg = config_from_dict(_config(args, precision))
    layers = layer_factories(model_spec(cfg), 1)
    opt = partial(CPUAdam, lr=1e-4)
    plan = plan_for_config(cfg)
    return Pipeline(layers, lm_loss, plan=plan, optimizer=opt, memory=memory, overlap_updates=overlap, **(clip or {}))


def _step(p: Pipeline, x: torch.Tensor, y: torch.Tensor, wait: bool = True) -> tuple[float, int, int]:
    """Seconds of one step (with wait, its updates included: the next step needs them; without, a delayed update's
    step, whose updates run under the next) and the bytes it read and wrote."""
    before = _io_bytes()
    with Stopwatch() as sw:
        p.train_batch(x, y)
        if wait:
            p.engine.wait_updates()
    after = _io_bytes()
    return sw.s, after[0] - before[0], after[1] - before[1]


def run(args: argparse.Namespace, rows: dict[str, tuple], steps: int, wait: bool = True) -> dict:
    """Each row {name: (precision, memory, overlap[, clip])} a Pipeline, all alive at once and stepped in turn (row by
    row within each step, so that the machine's drift touches every row alike); per row the median step
    seconds over `steps` steps after one untimed step (wait: as _step), the bytes read and written per step, and
    the pages of its out-of-core Adam's slots."""
    cfg = config_from_dict(_config(args, "fp32"))
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    pipes = {name: _pipeline(args, *spec) for name, spec in rows.items()}
    samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in rows}
    try:
        for s in range(steps + 1):
            x, y = data.batch(s, 4)
            for name, p in pipes.items():
                sample = _step(p, x, y, wait)
                if s:  # the first step learns the shapes and touches every buffer: not timed
                    samples[name].append(sample)
        out = {}
        for name, p in pipes.items():
            streamed = [st.states for st in p.engine.stages.values() if isinstance(st.states, SsdStreamStates)]
            slots = [states.optimizer.slots[0] for states in streamed]
            kind = buffer_kind(slots[0].data_ptr(), slots[0].numel() * slots[0].element_size()) if slots else ""
            out[name] = {
                "step_s": statistics.median(t for t, _, _ in samples[name]),
                "read": int(statistics.median(r for _, r, _ in samples[name])),
                "written": int(statistics.median(w for _, _, w in samples[name])),
                "pages": kind,
                "params": sum(st.numel for st in p.engine.stages.values()),
            }
        return out
    finally:
        for p in pipes.values():
            p.close()


def io_floor(folder: Path, read: int, written: int, pages: str) -> tuple[float, str]:
    """The largest of fio's times to read `read` bytes, write `written`, and do min of both at once."""
    qd, block = 8, MiB
    read, written = (max(block, n // block * block) for n in (read, written))  # whole requests, rounded down
    both = min(read, written)
    with fio_buffers("huge" if pages == "huge" else "4k", 2 * qd * block) as fio:
        f = folder / "fio.dat"
        fio_rw(f, 2 * max(read, written), block, qd, fio.iomem, "write")  # lays the file out
        t = max(
            fio_rw(f, read, block, qd, fio.iomem, "read"),
            fio_rw(f, written, block, qd, fio.iomem, "write"),
            fio_rw(f, both, block, qd, fio.iomem, "readwrite-at-once"),
        )
        f.unlink()
        return t, fio.note


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--device-mb", type=float, default=512.0)
    p.add_argument("--budget-mb", type=float, default=160.0, help="host_budget_mb of the ssd rows")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (the bf16 row: 2)")
    p.add_argument("--ssd-dir", default=None, help="a folder on the disk to measure (default: a temp folder)")
    p.add_argument("--clip", action="store_true", help="add the clipping rows (the speculative update's)")
    p.add_argument("--delayed", action="store_true", help="add the ssd row with the delayed update, run alone")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as tmp:

        def on_ssd(name: str) -> MemoryConfig:
            return MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=f"{tmp}/{name}", host_budget_mb=args.budget_mb)

        fp32 = {"host fp32": ("fp32", None, True), "ssd": ("fp32", on_ssd("a"), True)}
        fp32["ssd serialized"] = ("fp32", on_ssd("b"), False)
        if args.clip:
            fp32.update(
                {name: ("fp32", on_ssd(f"c{i}"), True, clip) for i, (name, clip) in enumerate(CLIP_ROWS.items())}
            )
            fp32["host clip, speculative"] = ("fp32", None, True, CLIP_ROWS["ssd clip, speculative"])
        rows = run(args, fp32, args.steps)
        rows["host bf16"] = run(args, {"host bf16": ("bf16", None, True)}, 2)["host bf16"]
        if args.delayed:
            delayed = {"ssd delayed": ("fp32", on_ssd("d"), True, {"delayed_update": 0})}
            rows["ssd delayed"] = run(args, delayed, args.steps, wait=False)["ssd delayed"]
        ssd = rows["ssd"]
        t_io, note = io_floor(Path(tmp), ssd["read"], ssd["written"], ssd["pages"])
    host = rows["host fp32"]["step_s"]
    floor = max(host, t_io)
    table = [
        [
            name,
            f"{r['step_s']:.3f}",
            f"{r['read'] / MiB:.0f}",
            f"{r['written'] / MiB:.0f}",
            f"{r['step_s'] / floor:.2f}x",
        ]
        for name, r in rows.items()
    ]
    print(f"GPT {args.blocks}x{args.d_model}: {ssd['params'] / 1e6:.1f}M parameters in {args.stages} stages, one rank")
    print(markdown_table(["row", "step s", "read MiB", "written MiB", "vs floor"], table))
    print(
        f"floor {floor:.3f} s = max(host fp32 step {host:.3f} s, I/O floor {t_io:.3f} s: fio on {note}; the "
        f"Adam slots' pages: {ssd['pages']}); ssd step {ssd['step_s'] / floor:.2f}x the floor (bar 1.2x); overlap "
        f"gain {rows['ssd serialized']['step_s'] / ssd['step_s']:.2f}x (serialized / overlapped); bf16 / fp32 "
        f"with host states {rows['host bf16']['step_s'] / host:.2f}x"
    )
    if args.delayed:
        print(f"delayed update: ssd step {rows['ssd delayed']['step_s'] / floor:.2f}x the floor")
    if args.clip:
        serialized, gain = rows["ssd serialized"]["step_s"], rows["ssd serialized"]["step_s"] / ssd["step_s"]
        gains = {name: serialized / rows[name]["step_s"] for name in CLIP_ROWS}
        print(
            "overlap gain with clipping: "
            + "; ".join(f"{name} {g:.2f}x ({g / gain:.3f} of the gain without)" for name, g in gains.items())
            + "; host states: the speculative update's copies cost "
            + f"{rows['host clip, speculative']['step_s'] / host:.3f}x the host fp32 step"
        )


if __name__ == "__main__":
    main()
