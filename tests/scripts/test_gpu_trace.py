"""gpu_check's readers of a profiler trace (gpu_trace) and of the allocator's history (gpu_memory), on
hand-made events whose answers are worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_memory
import gpu_trace


def _kernel(start, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": start, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}  # fmt: skip


def _launch(end, corr, tid=1, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": end - 1, "dur": 1, "pid": 9, "tid": tid,
            "args": {"correlation": corr}}  # fmt: skip


def _copy(start, dur):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": start, "dur": dur,
            "pid": 0, "tid": 30, "args": {}}  # fmt: skip


def _sync(tid):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 1, "pid": 9, "tid": tid}


def test_a_copy_the_compute_waited_through_is_exposed_and_one_beside_idle_compute_is_hidden():
    # kernel 1 runs [0, 10); kernel 2 is launched at 12 but starts at 30 (it waited: a stall [12, 30)); kernel 3
    # is launched at 60 and starts at once. Copy A [15, 25) lies in the stall; copy B [40, 50) beside an idle GPU.
    events = [_kernel(0, 10, 1), _launch(-5, 1), _kernel(30, 5, 2), _launch(12, 2), _kernel(60, 5, 3), _launch(60, 3)]
    events += [_copy(15, 10), _copy(40, 10), _sync(1), _sync(1), _sync(2)]
    assert gpu_trace.stalls(events) == [(12, 30)]
    o = gpu_trace.overlap(events, steps=1, visits=2)
    assert o["copy_us"] == 20 and o["exposed_us"] == 10 and o["hidden"] == 0.5 and o["under_kernels"] == 0.0
    assert o["syncs_per_step"] == 2 and o["syncs_per_visit"] == 1 and o["helper_syncs_per_step"] == 1


def test_a_kernel_launched_through_the_driver_is_not_a_stall():
    events = [_kernel(0, 10, 1), _launch(-5, 1), _kernel(20, 5, 2), _launch(20, 2, name="cuLaunchKernel")]
    events[-1]["cat"] = "cuda_driver"
    assert gpu_trace.stalls(events) == []


@pytest.mark.parametrize("spans,expected", [([(0, 4), (2, 6)], 6), ([(5, 7), (0, 1)], 3), ([(-3, 20)], 10)])
def test_covered_counts_overlapping_spans_once(spans, expected):
    assert gpu_trace.covered(0, 10, spans) == expected


def test_the_peak_is_the_largest_live_total_and_names_our_frame():
    ours = [{"filename": "/x/torch/nn/functional.py", "line": 3, "name": "linear"},
            {"filename": "/r/mobiuspipe/runtime/compute.py", "line": 9, "name": "fwd"}]  # fmt: skip
    trace = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 20, "frames": ours[:1]},
        {"action": "free_requested", "addr": 1, "size": 10},
        {"action": "alloc", "addr": 3, "size": 5, "frames": []},
    ]
    peak, live = gpu_memory.peak_live(trace)
    assert peak == 30 and sorted(e["addr"] for e in live) == [1, 2]
    assert gpu_memory.where(live[0]) == "mobiuspipe/runtime/compute.py:9 fwd"
    assert gpu_memory.where(live[1]) == "/x/torch/nn/functional.py:3 linear"
    lines = gpu_memory.summary({"device_traces": [trace]})
    assert lines[0].startswith("device 0: peak 0.00 MiB live in 2 blocks") and len(lines) == 3
