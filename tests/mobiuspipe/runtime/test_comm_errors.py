"""A peer lost while a message is being posted (gloo raises at isend/irecv when the other end closed its
connection): Comm names this rank, the peer and the message, as for a failed wait."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mobiuspipe.errors import PeerLostError
from mobiuspipe.runtime.peers.comm import Comm, TensorSpec

RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1196: Connection reset by peer\nmore"


def _reset(*args, **kwargs):
    raise RuntimeError(RESET)


@pytest.mark.parametrize("post", ["isend", "irecv", "all_reduce"])
def test_an_error_on_posting_names_the_peer(monkeypatch, post):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "0")  # gloo's own link, whose posting this test breaks
    monkeypatch.setattr(dist, post, _reset)
    comm = Comm(rank=0, timeout_s=5)
    cpu = torch.device("cpu")
    call = {
        "isend": lambda: comm.send(torch.ones(3), 1, 7, "the activation of stage 0"),
        "irecv": lambda: comm.recv(TensorSpec((3,), torch.float32), cpu, 1, 7, "the activation of stage 0"),
        "all_reduce": lambda: comm.all_reduce(torch.ones(3), dist.ReduceOp.SUM, "the loss"),
    }[post]
    with pytest.raises(PeerLostError) as e:
        call()
    text = str(e.value)
    assert text.startswith("rank 0: ") and "Connection reset by peer" in text and "more" not in text
    assert ("another rank" if post == "all_reduce" else "rank 1") in text.split("failed")[1]


class _Recorded:
    """A request that records how it was waited on."""

    def __init__(self) -> None:
        self.waits: list[object] = []

    def is_completed(self) -> bool:
        return True

    def wait(self, *args) -> bool:
        self.waits.append(args)
        return True


@pytest.mark.parametrize("cuda", [False, True])
def test_receives_block_the_host_only_off_nccl(monkeypatch, cuda):
    """On NCCL a wait with a timeout blocks the host until the receive ends; Comm waits without one there (the
    process group's watchdog keeps the deadline) and with one on gloo."""
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    work = _Recorded()
    monkeypatch.setattr(dist, "irecv", lambda *a, **k: work)
    comm = Comm(rank=0, timeout_s=5)
    comm.recv(TensorSpec((3,), torch.float32), torch.device("cpu"), 1, 7, "the activation of stage 0")
    assert work.waits == ([()] if cuda else [(comm.timeout,)])
