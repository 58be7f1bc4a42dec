"""Per-step metrics of a training run: a progress bar on a terminal, plain lines otherwise, and a JSONL file."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from foundation.units import MiB

__all__ = ["StepMetrics", "Reporter"]


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

    def line(self, steps: int) -> str:
        scale = "" if self.loss_scale is None else f"  scale {self.loss_scale:g}"
        return (
            f"step {self.step + 1}/{steps}  loss {self.loss:.4f}  {self.tokens_per_s:,.0f} tok/s  "
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
