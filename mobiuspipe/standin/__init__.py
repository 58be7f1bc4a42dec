"""CPU stand-ins held to CUDA's and NCCL's rules, switched on by MOBIUSPIPE_STRICT=1 (the test suite sets it).

A stand-in that forgives what CUDA does not proves nothing about the GPU. Under strict mode:
- p2p: the sends and receives of one communicator with one peer run in post order on one queue, and a send
  completes only once the peer's matching receive has reached the head of its queue (NCCL's rule for
  messages too large for its buffers, where gloo lets every send through);
- places: a tensor in a gpu's memory and one in (pinned) host memory refuse to meet in one op, except
  through the copy functions, as CUDA refuses a cuda and a cpu tensor;
- threads: copy streams and events are used only from a thread that set its device, as a new CUDA thread's
  current device is 0 whatever rank it serves; a mark of the compute queued so far is taken only on the thread
  that queues the compute (elsewhere it would cover whatever compute happened to be queued then);
- page-locking: no host memory is page-locked during a pass or an evaluation (Device.stepping), where NCCL's
  messages may be in flight, since page-locking may synchronize the whole gpu, which waits for them.
"""

from __future__ import annotations

import os

__all__ = ["STRICT_ENV", "strict", "StandInError"]

STRICT_ENV = "MOBIUSPIPE_STRICT"
"""The environment variable that makes the stand-ins strict ("1"); unset or "0" leaves them lax."""


def strict() -> bool:
    """Whether the stand-ins follow CUDA's and NCCL's rules (read at each call: tests switch it)."""
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


class StandInError(RuntimeError):
    """The code did something CUDA or NCCL would refuse, hang on, or run out of order (a bug, not a user's
    mistake); the message names the rule it broke."""
