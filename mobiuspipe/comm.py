"""Activations and their gradients between ranks: torch.distributed send/recv with a deadline per receive.

gloo carries CPU tensors (the stand-in); NCCL carries device tensors on CUDA. Without GPU peer-to-peer,
NCCL stages the bytes through host memory itself. A receive that fails or outlives the timeout raises
PeerLostError naming this rank, the peer and what was awaited, instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from mobiuspipe.errors import PeerLostError

__all__ = ["Comm"]


class Comm:
    """Point-to-point traffic of one rank; sends are asynchronous and flushed by flush()."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        self._sends: list[tuple[object, torch.Tensor, int, str]] = []

    def send(self, t: torch.Tensor, dst: int, tag: int, what: str) -> None:
        t = t.contiguous()
        self._sends.append((dist.isend(t, dst, tag=tag), t, dst, what))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int,
             what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        self._wait(dist.irecv(buf, src, tag=tag), f"rank {src}", f"receiving {what} from rank {src}")
        return buf

    def flush(self) -> None:
        """Wait until every send of this rank has been taken by its receiver."""
        sends, self._sends = self._sends, []
        for work, _, dst, what in sends:
            self._wait(work, f"rank {dst}", f"sending {what} to rank {dst}")

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """In-place all-reduce of t over every rank, under the same deadline as receives."""
        try:
            work = dist.all_reduce(t, op=op, async_op=True)
        except RuntimeError as e:
            raise PeerLostError(self._message("another rank", what, str(e).splitlines()[0])) from e
        self._wait(work, "another rank", f"all-reduce of {what}")
        return t

    def _wait(self, work, peer: str, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerLostError(self._message(peer, what, str(e).splitlines()[0])) from e
        if ok is False:
            raise PeerLostError(self._message(peer, what, f"no answer within {self.timeout.total_seconds():g} s"))

    def _message(self, peer: str, what: str, cause: str) -> str:
        return (f"rank {self.rank}: {what} failed ({cause}); {peer} has probably died or hangs: look at its log "
                f"above. Raise runtime.comm_timeout_s if {peer} is only slow")
