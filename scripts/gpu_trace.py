"""What a torch.profiler Chrome trace of pipeline steps says about overlap: load time the compute waited through,
and the host-blocking synchronizations of the threads that drive the compute.

Times in the trace are microseconds. Definitions:
  stall   an interval in which the compute stream had a kernel ready (launched by the host, the stream's previous
          kernel ended) that had not started: it was waiting on an event, i.e. on a copy or another stream
  exposed the part of a host -> device copy that overlaps a stall: load time the compute waited through
  hidden  1 - exposed / copy time. A copy that runs while the GPU idles for lack of launched work costs the step
          nothing and counts as hidden; the share of copy time that overlaps a running kernel (`under_kernels`)
          is reported beside it
  syncs   cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize and blocking cudaMemcpy calls on a
          thread that launches kernels (the pipeline's thread and autograd's); a helper thread that waits for an
          offload before its host update blocks nothing the GPU waits for and is counted apart
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SLACK_US = 2.0
"""A kernel that starts within this many microseconds of being ready has not stalled (launch latency)."""


def load(path: str | Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file."""
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]


def compute_stream(events: list[dict]) -> int | None:
    """The stream that ran the most kernels."""
    streams = Counter(e["args"].get("stream") for e in events if e.get("cat") == "kernel")
    return max(streams, key=lambda s: streams[s]) if streams else None


def stalls(events: list[dict]) -> list[tuple[float, float]]:
    """The compute stream's stalls (start, end): a kernel ready before it started (see the module's docstring)."""
    launched = {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    stream = compute_stream(events)
    on_stream = [e for e in events if e.get("cat") == "kernel" and e["args"].get("stream") == stream]
    kernels = sorted(on_stream, key=lambda e: e["ts"])
    out, prev_end = [], None
    for k in kernels:
        ready = max(launched.get(k["args"].get("correlation"), k["ts"]), prev_end if prev_end is not None else 0.0)
        if k["ts"] - ready > SLACK_US:
            out.append((ready, k["ts"]))
        prev_end = k["ts"] + k["dur"]
    return out


def covered(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """How much of [start, end) the spans cover (spans may overlap each other)."""
    out, reach = 0.0, start
    for a, b in sorted(spans):
        if b <= reach or a >= end:
            continue
        a = max(a, reach)
        out += min(b, end) - a
        reach = min(b, end)
    return out


def overlap(events: list[dict], steps: int, visits: int) -> dict:
    """hidden, under_kernels, copy_us, exposed_us, syncs_per_step, syncs_per_visit, helper_syncs_per_step."""
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if "Memcpy HtoD" in e["name"]]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    waits = stalls(events)
    total = sum(b - a for a, b in copies)
    exposed = sum(covered(a, b, waits) for a, b in copies)
    under = sum(covered(a, b, kernels) for a, b in copies)
    launching = {(e["pid"], e["tid"]) for e in events if e["name"] in LAUNCHES}
    syncs = Counter((e["pid"], e["tid"]) in launching for e in events if e["name"] in SYNCS)
    return {
        "hidden": 1.0 - exposed / total if total else 1.0,
        "under_kernels": under / total if total else 1.0,
        "copy_us": total,
        "exposed_us": exposed,
        "syncs_per_step": syncs[True] / steps,
        "syncs_per_visit": syncs[True] / steps / max(1, visits),
        "helper_syncs_per_step": syncs[False] / steps,
    }
