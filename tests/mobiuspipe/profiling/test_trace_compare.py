"""Reading a run's Chrome trace back and setting its actions beside the simulator's, against hand-made steps."""

from __future__ import annotations

import pytest

from mobiuspipe.profiling.trace_compare import compare_actions, format_rows, kind_seconds, report, steady_ratio
from mobiuspipe.runtime.action_trace import TracedAction, as_sim_result, read_chrome, write_chrome
from partition.sim.types import SimResult


def _rec(step, kind, stage, mb, start_ms, end_ms):
    return TracedAction(step, kind, stage, mb, 10.0 + start_ms / 1e3, 10.0 + end_ms / 1e3)


# rank 0 runs stage 0 (F then B, two microbatches), rank 1 stage 1; two traced steps, the second 3 ms slower in F0.1
RANK0 = [
    r
    for step, extra in ((4, 0.0), (5, 3.0))
    for r in (
        _rec(step, "step", -1, -1, 100 * step, 100 * step + 60),
        _rec(step, "L", 0, -1, 100 * step, 100 * step + 1),
        _rec(step, "F", 0, 0, 100 * step + 1, 100 * step + 6),
        _rec(step, "SA", 0, 0, 100 * step + 6, 100 * step + 6.5),
        _rec(step, "F", 0, 1, 100 * step + 7, 100 * step + 11 + extra),
        _rec(step, "RG", 0, 0, 100 * step + 20, 100 * step + 30),
        _rec(step, "B", 0, 0, 100 * step + 30, 100 * step + 42),
        _rec(step, "B", 0, 1, 100 * step + 42, 100 * step + 52),
    )
]
RANK1 = [_rec(s, "B", 1, mb, 100 * s + 12 + 8 * mb, 100 * s + 20 + 8 * mb) for s in (4, 5) for mb in (0, 1)]


def test_a_written_trace_reads_back_as_it_was_recorded(tmp_path):
    path = write_chrome([RANK0, RANK1], tmp_path / "trace.json")
    back = read_chrome(path)
    assert [len(r) for r in back] == [len(RANK0), len(RANK1)]
    for got, want in zip(back[0] + back[1], RANK0 + RANK1):
        assert (got.step, got.kind, got.stage, got.microbatch) == (want.step, want.kind, want.stage, want.microbatch)
        assert got.end_s - got.start_s == pytest.approx(want.end_s - want.start_s, abs=1e-9)


PREDICTED = SimResult(
    step_time_s=0.05,
    compute_busy_s=(0.03, 0.016),
    events=(
        ("F", 0, 0, 0, 0.0, 0.004),
        ("F", 0, 0, 1, 0.004, 0.008),
        ("B", 0, 0, 0, 0.02, 0.030),
        ("B", 0, 0, 1, 0.03, 0.040),
        ("B", 1, 1, 0, 0.01, 0.018),
        ("B", 1, 1, 1, 0.018, 0.026),
        ("load", 0, 0, -1, 0.0, 0.001),
    ),
)


def test_each_stages_first_microbatch_and_the_rest_against_the_prediction():
    measured = [as_sim_result([RANK0, RANK1], step) for step in (4, 5)]
    rows = compare_actions(measured, PREDICTED)
    got = [(r.kind, r.stage, r.gpu, r.first, round(r.measured_s * 1e3, 6), round(r.predicted_s * 1e3, 6)) for r in rows]
    assert got == [
        ("F", 0, 0, True, 5.0, 4.0),
        ("F", 0, 0, False, 5.5, 4.0),  # 4 and 7 ms over the two steps: their median
        ("B", 0, 0, True, 12.0, 10.0),
        ("B", 0, 0, False, 10.0, 10.0),
        ("B", 1, 1, True, 8.0, 8.0),
        ("B", 1, 1, False, 8.0, 8.0),
    ]
    assert rows[1].ratio == pytest.approx(5.5 / 4.0)
    assert len(format_rows(rows)) == 1 + len(rows)


def test_seconds_per_step_by_kind_average_the_chosen_steps():
    per_kind = kind_seconds([RANK0, RANK1], [4, 5])
    assert per_kind[0]["F"] == pytest.approx((5 + 4 + 5 + 7) / 2 / 1e3)
    assert per_kind[0]["SA"] == pytest.approx(0.5e-3) and per_kind[0]["RG"] == pytest.approx(10e-3)
    assert per_kind[1] == {"B": pytest.approx(16e-3)}
    assert kind_seconds([RANK0], [4])[0]["F"] == pytest.approx(9e-3)


def test_the_report_and_its_steady_ratio():
    lines, ratio = report([RANK0, RANK1], PREDICTED, [4, 5])
    assert ratio == pytest.approx(1.0)  # the rest: 5.5/4, 10/10, 8/8: their median
    assert lines[0] == "predicted step 50.0 ms, compute per gpu 30.0 / 16.0 ms" and len(lines) == 1 + 7 + 2
    assert lines[-2].startswith("rank 0 ms per step: B 22.0, F 10.5, L 1.0, RG 10.0, SA 0.5, step 60.0")
    assert steady_ratio([]) != steady_ratio([])  # nan without rows
