"""The run config's `runtime:` section: how the ranks run (communication timeout, CPU threads, traced steps,
deterministic kernels)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from foundation.loader import Problem, rule
from mobiuspipe.config.section import AUTO_COUNT, Section

__all__ = ["RuntimeConfig", "MAX_THREADS"]

MAX_THREADS = 1024
"""The most torch threads a rank may ask for (more is a typo: torch would start them all)."""


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig(Section):
    """How the ranks run: communication timeout and CPU threads."""

    comm_timeout_s: float = 60.0
    """Seconds a receive may wait (s); longer fails with a message naming the peer rank (on gloo; on NCCL, the
    process group's timeout: its watchdog ends the rank, timing each operation from its post)."""
    threads: int | None = dataclasses.field(default=None, metadata=AUTO_COUNT)
    """Torch intra-op threads per rank (count): the compute on CPU stand-ins and the host update's CPU Adam kernel use
    them. auto (or null, or left out): each rank of this host gets its share of the cores the process may run on
    (their count over torchrun's LOCAL_WORLD_SIZE, at least 1; mobiuspipe/optim/host_threads.py)."""
    trace_steps: tuple[int, ...] = ()
    """Optimizer steps (0-based) whose every action each rank times: when it started and ended on the host's
    clock; the run writes them to out_dir/trace.json (Chrome trace events, like `mobiuspipe simulate --trace`)."""
    deterministic: bool = False
    """true: every rank runs torch's deterministic kernels (torch.use_deterministic_algorithms, and cuBLAS's
    workspace as it needs: CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), so that on a GPU a run and its resume
    repeat bit for bit; fp32 attention's backward otherwise adds with atomics. Some kernels run slower. On the
    CPU the kernels are deterministic anyway."""

    def check_values(self) -> list[Problem]:
        return [
            *rule(
                0 < self.comm_timeout_s <= 1e9,
                "comm_timeout_s",
                "a number of seconds > 0 and at most 1e9 (about 32 years)",
                repr(self.comm_timeout_s),
                "use e.g. 60.0",
            ),
            *rule(
                self.threads is None or 1 <= self.threads <= MAX_THREADS,
                "threads",
                f"a thread count in [1, {MAX_THREADS}]",
                repr(self.threads),
                "use auto (each rank's share of the cores), or the cores a rank may use",
            ),
            *rule(
                all(s >= 0 for s in self.trace_steps),
                "trace_steps",
                "a list of optimizer steps, each >= 0 (the first step is 0)",
                repr(list(self.trace_steps)),
                "use e.g. [5, 6]",
            ),
        ]
