"""scripts/gpu_check.py's report: its rows (a check, PASS, FAIL or information only, its figure and bar), printed as
they come and saved to gpu_check.json after each, and the run's count."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

__all__ = ["Table", "tally", "MIN_SECTION_S"]

MIN_SECTION_S = 20.0
"""Seconds of the time limit a section must have left to start."""


class Table:
    """The checks' rows, printed and saved to `path` after each row (a run stopped at its time limit keeps what it
    found)."""

    def __init__(self, path: Path, head: dict, time_limit_s: float = float("inf")) -> None:
        self.rows: list[dict] = []
        self.path, self.head, self.figures, self.machine = path, head, {}, {}
        self._deadline = time.monotonic() + time_limit_s

    def left(self, most: float = float("inf")) -> float:
        """Seconds of the time limit left (at most `most`): what a section's subprocess or wait may take."""
        return max(0.0, min(most, self._deadline - time.monotonic()))

    def add(self, check: str, ok: bool | None, figure: str, bar: str = "") -> None:
        """ok None: measured only (no bar on this machine)."""
        self.rows.append({"check": check, "ok": ok, "figure": figure, "bar": bar})
        mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
        print(f"{mark:5} {check:44} {figure}  {bar}", flush=True)
        self.save()

    def failed(self) -> list[str]:
        return [r["check"] for r in self.rows if r["ok"] is False]

    def save(self) -> None:
        out = {**self.head, "rows": self.rows, "figures": self.figures, "machine": self.machine}
        self.path.write_text(json.dumps({**out, "failed": self.failed()}, indent=1))

    def guarded(self, section: str, fn, *args):
        """fn(*args), or a failed row naming the error (its traceback printed) so the other sections still run; a
        row saying it was skipped (None) when less than MIN_SECTION_S of the time limit is left."""
        if self.left() < MIN_SECTION_S:
            self.add(section, None, f"skipped: {self.left():.0f} s of the time limit left")
            return None
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - one section's error is a failed row, not the end of the check
            traceback.print_exc()
            self.add(section, False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100] if str(e) else ''}")
            return None
        finally:
            print(f"      ({section}: {time.perf_counter() - start:.1f} s)", flush=True)


def tally(rows: list[dict]) -> str:
    """The run's count: checks that passed of those with a bar, and the rows that only inform."""
    checked = [r for r in rows if r["ok"] is not None]
    passed = sum(r["ok"] is True for r in checked)
    info = len(rows) - len(checked)
    return f"{passed} of {len(checked)} checks pass, {info} row{'s' if info != 1 else ''} information only"
