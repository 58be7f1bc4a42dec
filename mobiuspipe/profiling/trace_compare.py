"""A measured trace against the simulator's prediction, action by action: where a predicted step goes wrong.

Takes a run's traced records (runtime.trace_steps; action_trace.read_chrome reads out_dir/trace.json back) and
sets each stage's measured F and B durations beside the simulator's events for the same plan, a visit's first
microbatch apart from the rest (it runs on weights just loaded and, in B, a freshly zeroed gradient slot). Also
totals each rank's seconds per step by action kind, messages and waits included, which the simulator does not
draw.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from mobiuspipe.runtime.action_trace import TracedAction, as_sim_result
from partition.sim.types import SimResult

__all__ = ["ActionRow", "compare_actions", "kind_seconds", "format_rows", "report", "steady_ratio"]


@dataclass(frozen=True)
class ActionRow:
    """One stage's F or B, the visit's first microbatch (first=True) or the others: medians in seconds."""

    kind: str
    stage: int
    gpu: int
    first: bool
    measured_s: float
    predicted_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else float("inf")


def _durations(results: list[SimResult]) -> dict[tuple[str, int, int, bool], list[float]]:
    """(kind, stage, gpu, first microbatch) -> the durations of those F and B events over every result."""
    out: dict[tuple[str, int, int, bool], list[float]] = defaultdict(list)
    for r in results:
        for kind, gpu, stage, mb, start, end in r.events:
            if kind in ("F", "B"):
                out[(kind, stage, gpu, mb == 0)].append(end - start)
    return out


def compare_actions(measured: list[SimResult], predicted: SimResult) -> list[ActionRow]:
    """Each stage's F and B (first microbatch, rest) in the measured steps against the prediction, by stage."""
    got, want = _durations(measured), _durations([predicted])
    keys = sorted(set(got) & set(want), key=lambda k: (k[1], k[0] != "F", not k[3]))
    return [ActionRow(k[0], k[1], k[2], k[3], statistics.median(got[k]), statistics.median(want[k])) for k in keys]


def kind_seconds(per_rank: list[list[TracedAction]], steps: list[int]) -> list[dict[str, float]]:
    """Per rank: seconds per step spent in each action kind (the mean over `steps`)."""
    out = []
    for recs in per_rank:
        total: dict[str, float] = defaultdict(float)
        for r in recs:
            if r.step in steps:
                total[r.kind] += (r.end_s - r.start_s) / len(steps)
        out.append(dict(sorted(total.items())))
    return out


def format_rows(rows: list[ActionRow]) -> list[str]:
    """The rows as aligned text lines, in milliseconds."""
    lines = ["stage gpu kind microbatch  measured ms  predicted ms  measured/predicted"]
    for r in rows:
        which = "first" if r.first else "rest"
        lines.append(
            f"{r.stage:5d} {r.gpu:3d} {r.kind:>4s} {which:>10s}  {r.measured_s * 1e3:11.2f}  "
            f"{r.predicted_s * 1e3:12.2f}  {r.ratio:18.2f}"
        )
    return lines


def report(per_rank: list[list[TracedAction]], predicted: SimResult, steps: list[int]) -> tuple[list[str], float]:
    """The comparison of the traced `steps` with the predicted step as text lines (the prediction's step and
    compute, format_rows, each rank's ms per step by kind), and steady_ratio of its rows."""
    rows = compare_actions([as_sim_result(per_rank, s) for s in steps], predicted)
    busy = " / ".join(f"{b * 1e3:.1f}" for b in predicted.compute_busy_s)
    lines = [f"predicted step {predicted.step_time_s * 1e3:.1f} ms, compute per gpu {busy} ms", *format_rows(rows)]
    for g, kinds in enumerate(kind_seconds(per_rank, steps)):
        lines.append(f"rank {g} ms per step: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in kinds.items()))
    return lines, steady_ratio(rows)


def steady_ratio(rows: list[ActionRow]) -> float:
    """The median measured / predicted of the rows past a visit's first microbatch (nan without any); the last
    stage's F, which the simulator fuses into its B (0 s), is left out."""
    steady = [r.ratio for r in rows if not r.first and r.predicted_s > 0]
    return statistics.median(steady) if steady else float("nan")
