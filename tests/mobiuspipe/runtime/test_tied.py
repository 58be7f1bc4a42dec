"""The tied gradients' exchange between two ranks (runtime.tied), against a scripted peer: a chunk at a time, each
sent and added before the next, in gpu memory of two chunks; a half kept on the gpu read and added there a chunk at
a time, one in host memory or on the SSD read once and added once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.reduce import sum_of_squares
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import layer_factories, open_hf
from mobiuspipe.runtime import tied
from mobiuspipe.runtime.peers.comm import Comm
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.standin.places import gpu_of, plain
from partition.plan import Plan

CHUNK = 37
"""Elements a chunk in these tests: the table's 301 x 32 elements make many chunks, the last one short."""


class _Peer:
    """The other rank's side of the exchange: takes what is sent, gives `theirs` a chunk at a time; its ledger
    counts what Comm's would (a send until flushed)."""

    def __init__(self, theirs: torch.Tensor, device: Device):
        self.theirs, self.device, self.at = theirs, device, 0
        self.sent: list[torch.Tensor] = []
        self.ledger = DeviceLedger()

    def send(self, t, dst, tag, what):
        assert dst == 1 and tag == tied.TAG_BASE and gpu_of(t) == 0, (dst, tag, type(t))
        self.sent.append(plain(t).clone())
        self.ledger.hold(("sending", len(self.sent)), t)

    def recv(self, spec, device, src, tag, what):
        assert src == 1 and tag == tied.TAG_BASE and len(self.sent) == self.at // CHUNK + 1  # its own chunk first
        (n,) = spec.shape
        out = self.device.place(self.theirs[self.at : self.at + n].to(spec.dtype, copy=True))  # a new buffer
        self.at += n
        return out

    def flush(self):
        self.ledger.drop(("sending", len(self.sent)))


@pytest.mark.parametrize("optimizer", ["host", "ssd", "device"])
def test_an_exchange_adds_the_peers_half_a_chunk_at_a_time(tmp_path, hf_kit, monkeypatch, optimizer):
    monkeypatch.setattr(tied, "CHUNK", CHUNK)
    hf_kit.save_model("gpt2", tmp_path / "src", seed=2)
    m = open_hf(tmp_path / "src", 9)
    x, y = hf_kit.random_batches(1, 4, 9, seed=4)[0]
    ssd = optimizer == "ssd"
    memory = MemoryConfig(
        optimizer=optimizer, weights="ssd" if ssd else "host", ssd_dir=str(tmp_path / "ssd") if ssd else None
    )
    with Pipeline(layer_factories(m), lm_loss, sample=(x, y), num_microbatches=2, num_stages=3, memory=memory) as pipe:
        pipe.train_batch(x, y)  # gradients in the states
        (a, b), device = m.tied_params()[0], pipe.engine.device
        other = next(j for j, s in enumerate(pipe.plan.stages) if s.first <= int(b.split(".")[0]) <= s.last)
        mapping = [1 if j == other else 0 for j in range(pipe.plan.num_stages)]  # the head's stage on rank 1
        plan = cast(Plan, SimpleNamespace(stages=pipe.plan.stages, mapping=mapping, num_layers=pipe.plan.num_layers))
        stages = {j: s for j, s in pipe.engine.stages.items() if j != other}
        shapes = {b: tuple(pipe.state_dict()[b].shape)}
        monkeypatch.setattr(tied, "gather_all", lambda info, mine: [mine, shapes])
        ties = tied.TiedGrads([(a, b)], plan, stages, RankInfo(0, 2, 0, False))
        side = ties.pairs[0][0]
        assert side.slice is not None
        states, at, numel = pipe.engine.stages[side.stage].states, side.slice.offset, side.slice.numel
        noise = torch.randn(numel, dtype=torch.float64).float()  # a gradient no step leaves
        states.add_grads(at, device.place(noise) if optimizer == "device" else noise)
        before = plain(states.grad_slice(at, numel)).clone()
        theirs = torch.randn(before.numel(), dtype=torch.float64).to(before.dtype)
        peer = _Peer(theirs, device)
        to_host = Device.to_host
        copies = []
        monkeypatch.setattr(Device, "to_host", lambda self, t: copies.append(t.numel()) or to_host(self, t))
        reads, adds, read, add = [], [], states.grad_slice, states.add_grads
        monkeypatch.setattr(states, "grad_slice", lambda at, n: reads.append((at, n)) or read(at, n))
        monkeypatch.setattr(states, "add_grads", lambda at, t: adds.append((at, t.numel())) or add(at, t))
        fix = sum(float(t) for t in ties.sum(cast(Comm, peer), device, 0))
        monkeypatch.undo()
        after = plain(states.grad_slice(at, numel))
    assert torch.equal(torch.cat(peer.sent), before) and peer.at == before.numel() and before.abs().min() > 0
    assert torch.equal(after, before + theirs)
    assert fix == pytest.approx(sum_of_squares(before + theirs) - sum_of_squares(before), rel=1e-12)
    assert peer.ledger.peak_bytes == 2 * CHUNK * before.element_size()  # a chunk sent, a chunk received
    n = -(-before.numel() // CHUNK)
    assert copies == ([] if optimizer == "device" else [CHUNK] * (n - 1) + [before.numel() - (n - 1) * CHUNK])
    if optimizer == "device":  # a chunk at a time on the gpu
        assert reads == [(at + lo, min(CHUNK, numel - lo)) for lo in range(0, numel, CHUNK)] and len(adds) == n
    else:  # read and added once: the SSD store reads and writes a record at a time
        assert reads == adds == [(at, numel)]
