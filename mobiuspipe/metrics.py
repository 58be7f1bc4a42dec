"""Per-step metrics of a training run: a progress bar on a terminal, plain lines otherwise, and a JSONL file."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from foundation.units import MiB, fmt_bytes

__all__ = ["StepMetrics", "Reporter", "device_peak_line"]


@dataclass(frozen=True)
class StepMetrics:
    """What one step did; times are the largest over ranks, arena bytes the largest peak over ranks."""

    step: int
    loss: float
    tokens_per_s: float
    step_s: float
    compute_s: float
    load_s: float
    comm_s: float
    arena_peak_bytes: int
    arena_budget_bytes: int
    loss_scale: float | None = None
    """fp16: the loss scale of the step (None without loss scaling)."""
    skipped: bool = False
    """fp16: the step's gradients overflowed on some rank, so the update was skipped."""
    device_peak_bytes: int = 0
    """The largest measured device peak over ranks in the step (arena in use + activations + buffers +
    messages; StepResult.device_peak_bytes)."""
    lr: float | None = None
    """The learning rate of the step's updates (train.lr_schedule); None when the loop did not set one."""

    def line(self, steps: int) -> str:
        scale = "" if self.loss_scale is None else f"  scale {self.loss_scale:g}"
        lr = "" if self.lr is None else f"  lr {self.lr:.3g}"
        return (
            f"step {self.step + 1}/{steps}  loss {self.loss:.4f}{lr}  {self.tokens_per_s:,.0f} tok/s  "
            f"step {self.step_s * 1e3:.0f} ms (compute {self.compute_s * 1e3:.0f} / load {self.load_s * 1e3:.0f}"
            f" / comm {self.comm_s * 1e3:.0f})  arena peak {self.arena_peak_bytes / MiB:.2f}"
            f" of {self.arena_budget_bytes / MiB:.2f} MiB{scale}{'  (overflow: step skipped)' if self.skipped else ''}"
        )


class Reporter:
    """Shows each step on `stream` (a bar when it is a terminal; None = silent) and appends it to
    out_dir/metrics.jsonl."""

    def __init__(self, steps: int, log_every: int, out_dir: str | None, stream: TextIO | None = sys.stdout):
        self.steps, self.log_every, self.stream = steps, log_every, stream
        self.tty = stream is not None and stream.isatty()
        self.file = None
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(out_dir) / "metrics.jsonl", "w")

    def __call__(self, m: StepMetrics) -> None:
        if self.file:
            self.file.write(json.dumps(asdict(m)) + "\n")
            self.file.flush()
        last = m.step + 1 == self.steps
        if self.stream is None:
            return
        if self.tty:
            done = int(30 * (m.step + 1) / self.steps)
            self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {m.line(self.steps)}" + ("\n" if last else ""))
        elif (m.step + 1) % self.log_every == 0 or last:
            self.stream.write(m.line(self.steps) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def device_peak_line(measured: list[int], planned: list[int], source: str, parts: dict[str, int]) -> str:
    """One line comparing each rank's measured device peak over the run with the plan's figure for its gpu
    (partition.device_peak), saying which is larger and by how much; `parts` explains the largest rank's
    peak (the ledger's bytes by kind)."""
    ranks = [
        f"rank {g} {fmt_bytes(m)} vs {fmt_bytes(p)}: {_larger(m, p)}" for g, (m, p) in enumerate(zip(measured, planned))
    ]
    top = max(range(len(measured)), key=lambda g: measured[g])
    held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    return (
        f"device peak, measured ({source}) vs planned (arena + largest stage activations): {'; '.join(ranks)}; "
        f"rank {top} at its peak held {held}"
    )


def _larger(measured: int, planned: int) -> str:
    if measured == planned:
        return "equal"
    who = "measured" if measured > planned else "planned"
    rel = f" ({(measured - planned) / planned:+.0%} of plan)" if planned else ""
    return f"{who} larger by {fmt_bytes(abs(measured - planned))}{rel}"
