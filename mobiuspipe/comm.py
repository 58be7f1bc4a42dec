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
        self._wait(dist.irecv(buf, src, tag=tag), src, f"receiving {what}")
        return buf

    def flush(self) -> None:
        """Wait until every send of this rank has been taken by its receiver."""
        sends, self._sends = self._sends, []
        for work, _, dst, what in sends:
            self._wait(work, dst, f"sending {what}")

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerLostError(self._message(peer, what, str(e).splitlines()[0])) from e
        if ok is False:
            raise PeerLostError(self._message(peer, what, f"no answer within {self.timeout.total_seconds():g} s"))

    def _message(self, peer: int, what: str, cause: str) -> str:
        return (f"rank {self.rank}: {what} from/to rank {peer} failed ({cause}); rank {peer} has probably died or "
                f"hangs: look at its log above. Raise runtime.comm_timeout_s if rank {peer} is only slow")
