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
    """Seconds a rank may give no sign of life (s): each rank beats in the job's store from a thread of its own, and
    a rank that has not for this long (its process died or is stopped) is lost: every other rank stops with a
    message naming it. A live rank may be busy as long as it needs (a checkpoint, SSD states' set-up, a long
    stage)."""
    hang_timeout_s: float = 1800.0
    """Seconds live ranks may wait for one message or collective (s): the process group's deadline, which ends a
    hang (ranks waiting on each other). NCCL times an operation from its post, so on a gpu it must exceed the
    longest step, and the start-up's planning and SSD set-up: rank 0 warns when 3 of the plan's predicted passes
    would outlast it."""
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
                self.comm_timeout_s <= self.hang_timeout_s <= 1e9,
                "hang_timeout_s",
                f"a number of seconds >= comm_timeout_s ({self.comm_timeout_s:g}) and at most 1e9",
                repr(self.hang_timeout_s),
                "use e.g. 1800.0 (30 minutes), more than a step takes",
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
