"""A measured trace of chosen steps: when each schedule action of a rank ran, on the host's monotonic clock.

The engine records every action it dispatches in a traced step (its kind, stage, microbatch, start and end,
time.perf_counter seconds: CLOCK_MONOTONIC, one clock for every rank on a host), the final wait for its sends
("flush") and each stage's host update ("U", recorded by the updater thread when it ends); the pipeline adds
the step's own span ("step"). With gradient accumulation each pass's actions are recorded under the step.
`write_chrome` turns the ranks' records into Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev) beside
the simulator's (`mobiuspipe simulate --trace`): one process per rank, a thread for its computations, one for
messages and one for weights, swaps and updates, times in microseconds from the earliest record; `read_chrome`
reads such a file back.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from partition.sim.types import SimResult

__all__ = ["TracedAction", "ActionTrace", "chrome", "write_chrome", "read_chrome", "as_sim_result"]

SIM_KINDS = {"F": "F", "B": "B", "L": "load", "O": "offload", "U": "update"}
"""The simulator's event kind of each traced action it also has (messages, swaps and releases it does not draw)."""

THREADS = {"F": "compute", "B": "compute", "SA": "comm", "RA": "comm", "SG": "comm", "RG": "comm", "flush": "comm"}
"""Chrome thread of each action kind; the rest (L, R, O, SO, SI) and the pipeline's own spans go to "copy"."""


@dataclass(frozen=True)
class TracedAction:
    """One action of a traced step: kind is the schedule's letter ("F", "B", "L", "SA", ...), "flush", "U" (a
    host update) or "step"; stage and microbatch -1 where none applies; start_s and end_s in time.perf_counter
    seconds."""

    step: int
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float


class ActionTrace:
    """The records of the steps in `steps` (0-based optimizer steps); other steps cost one set lookup."""

    def __init__(self, steps) -> None:
        self.steps = frozenset(steps)
        self.records: list[TracedAction] = []

    def wants(self, step: int) -> bool:
        return step in self.steps

    def add(
        self, step: int, kind: str, stage: int, microbatch: int, start_s: float, end_s: float | None = None
    ) -> None:
        """Record one span (end_s: now when not given)."""
        end = time.perf_counter() if end_s is None else end_s
        self.records.append(TracedAction(step, kind, stage, microbatch, start_s, end))


def _name(r: TracedAction) -> str:
    if r.stage < 0:
        return r.kind
    return f"{r.kind}{r.stage}" + (f".{r.microbatch}" if r.microbatch >= 0 else "")


def chrome(records: list[TracedAction], rank: int, origin_s: float) -> list[dict]:
    """Chrome trace events ("X", complete) of one rank's records, times in microseconds after origin_s."""
    return [
        {
            "name": _name(r),
            "cat": r.kind,
            "ph": "X",
            "ts": (r.start_s - origin_s) * 1e6,
            "dur": (r.end_s - r.start_s) * 1e6,
            "pid": rank,
            "tid": THREADS.get(r.kind, "copy"),
            "args": {"step": r.step},
        }
        for r in records
    ]


def write_chrome(per_rank: list[list[TracedAction]], path: str | Path) -> Path:
    """One Chrome trace of every rank's records (on one host's clock), from the earliest record; returns path."""
    origin = min((r.start_s for recs in per_rank for r in recs), default=0.0)
    events = [e for rank, recs in enumerate(per_rank) for e in chrome(recs, rank, origin)]
    meta = [{"name": "process_name", "ph": "M", "pid": g, "args": {"name": f"rank {g}"}} for g in range(len(per_rank))]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}) + "\n", encoding="utf-8")
    return path


def read_chrome(path: str | Path) -> list[list[TracedAction]]:
    """Every rank's records of a trace that write_chrome wrote (seconds from its origin)."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    per_rank: dict[int, list[TracedAction]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        kind, rest = e["cat"], e["name"][len(e["cat"]) :]
        stage, _, mb = rest.partition(".")
        start = e["ts"] / 1e6
        per_rank[e["pid"]].append(
            TracedAction(
                e["args"]["step"],
                kind,
                int(stage) if stage else -1,
                int(mb) if mb else -1,
                start,
                start + e["dur"] / 1e6,
            )
        )
    return [per_rank[g] for g in range(max(per_rank, default=-1) + 1)]


def as_sim_result(per_rank: list[list[TracedAction]], step: int) -> SimResult:
    """Every rank's traced `step` as the simulator's SimResult (times from the step's first record; the step time
    its last record's end), so that partition.report.trace draws the measured step as it draws a predicted one."""
    recs = [(g, r) for g, recs in enumerate(per_rank) for r in recs if r.step == step]
    if not recs:
        raise ValueError(f"no rank traced step {step}: trace it (runtime.trace_steps) first")
    origin = min(r.start_s for _, r in recs)
    events = sorted(
        (
            (SIM_KINDS[r.kind], g, r.stage, r.microbatch, r.start_s - origin, r.end_s - origin)
            for g, r in recs
            if r.kind in SIM_KINDS
        ),
        key=lambda e: (e[4], e[1]),
    )
    n = len(per_rank)
    busy = tuple(sum(e[5] - e[4] for e in events if e[1] == g and e[0] in ("F", "B")) for g in range(n))
    span = max(r.end_s for _, r in recs) - origin
    return SimResult(step_time_s=span, compute_busy_s=busy, events=tuple(events), link_model="measured")
