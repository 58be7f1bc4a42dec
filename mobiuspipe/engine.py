"""Runs one rank's schedule for one step: a dispatch table from action kind to a small method.

State of a step lives here: the stage inputs saved to host for the recompute, received activations and
gradients, outputs waiting to be sent. Each method times itself into compute / load / comm buckets.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mobiuspipe.comm import Comm
from mobiuspipe.device import Device
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.stage import Stage

__all__ = ["Engine", "StepTimes"]


@dataclass
class StepTimes:
    """Seconds this rank spent computing, waiting for loads, and waiting on communication."""

    compute_s: float = 0.0
    load_s: float = 0.0
    comm_s: float = 0.0


class Engine:
    """One rank: its stages, arena, comm; run_step() executes the schedule once."""

    def __init__(self, mapping: list[int], rank: int, stages: dict[int, Stage], schedule: list[Action],
                 device: Device, arena: DeviceArena, comm: Comm, act_shape: tuple[int, ...], microbatches: int):
        self.mapping, self.rank, self.stages, self.schedule = mapping, rank, stages, schedule
        self.device, self.arena, self.comm = device, arena, comm
        self.act_shape, self.m = act_shape, microbatches
        self.last = len(mapping) - 1
        self.host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optimizer")
        self._dispatch = {Kind.LOAD: self._load, Kind.RELEASE: self._release, Kind.FWD: self._fwd,
                          Kind.BWD: self._bwd, Kind.SEND_ACT: self._send_act, Kind.RECV_ACT: self._recv_act,
                          Kind.SEND_GRAD: self._send_grad, Kind.RECV_GRAD: self._recv_grad,
                          Kind.OFFLOAD: self._offload}

    def run_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, StepTimes]:
        """One optimizer step over the batch (x, y); returns this rank's share of the loss and its times."""
        self.xs, self.ys = x.chunk(self.m), y.chunk(self.m)
        self.saved: dict[tuple[int, int], torch.Tensor] = {}
        self.inbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self.outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self.loss, self.times, self.step = 0.0, StepTimes(), step
        for a in self.schedule:
            self._dispatch[a.kind](a)
        t0 = time.perf_counter()
        self.comm.flush()
        self.times.comm_s += time.perf_counter() - t0
        return self.loss, self.times

    def finish(self) -> None:
        """Wait for every pending host update (call before reading weights or exiting)."""
        for s in self.stages.values():
            s.wait_update()
        self.host.shutdown(wait=True)
        self.device.close()

    # -- weights -------------------------------------------------------------------------------
    def _load(self, a: Action) -> None:
        t0 = time.perf_counter()
        self.stages[a.stage].load(self.arena, self.device)
        self.times.load_s += time.perf_counter() - t0

    def _release(self, a: Action) -> None:
        self.stages[a.stage].release(self.arena)

    def _ready(self, stage: Stage) -> None:
        t0 = time.perf_counter()
        stage.wait_loaded()
        self.times.load_s += time.perf_counter() - t0

    def _offload(self, a: Action) -> None:
        t0 = time.perf_counter()
        self.stages[a.stage].offload_and_update(self.arena, self.host)
        self.times.load_s += time.perf_counter() - t0

    # -- compute -------------------------------------------------------------------------------
    def _input(self, j: int, i: int) -> torch.Tensor:
        if j == 0:
            return self.xs[i].to(self.device.torch_device)
        return self.inbox.pop((Kind.RECV_ACT, j, i))

    def _fwd(self, a: Action) -> None:
        j, i, stage = a.stage, a.microbatch, self.stages[a.stage]
        self._ready(stage)
        x = self._input(j, i)
        self.saved[(j, i)] = x.to("cpu", copy=True) if self.device.is_cuda else x  # host checkpoint
        if j == self.last:
            return  # the last stage's forward is fused into its backward (loss and gradient at once)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.outbox[(Kind.SEND_ACT, j, i)] = stage.forward(x, with_grad=False)
        self.times.compute_s += time.perf_counter() - t0

    def _bwd(self, a: Action) -> None:
        j, i, stage = a.stage, a.microbatch, self.stages[a.stage]
        self._ready(stage)
        if stage.grads is None:
            stage.begin_backward(self.arena)
        t0 = time.perf_counter()
        x = self.saved.pop((j, i)).to(self.device.torch_device)
        if j > 0:
            x.requires_grad_(True)
        out = stage.forward(x, with_grad=True)
        if j == self.last:
            loss = lm_loss(out, self.ys[i].to(out.device)) / self.m
            self.loss += float(loss.detach())
            loss.backward()
        else:
            out.backward(self.inbox.pop((Kind.RECV_GRAD, j, i)))
        if j > 0:
            self.outbox[(Kind.SEND_GRAD, j, i)] = x.grad
        self.times.compute_s += time.perf_counter() - t0

    # -- communication -------------------------------------------------------------------------
    def _tag(self, kind: Kind, j: int, i: int) -> int:
        return ((j * self.m + i) * 2 + (kind in (Kind.SEND_GRAD, Kind.RECV_GRAD))) % (1 << 30)

    def _send(self, a: Action, dst_stage: int, what: str) -> None:
        t0 = time.perf_counter()
        t = self.outbox.pop((a.kind, a.stage, a.microbatch))
        if self.mapping[dst_stage] == self.rank:  # same gpu: hand over without the network
            recv_kind = Kind.RECV_ACT if a.kind is Kind.SEND_ACT else Kind.RECV_GRAD
            self.inbox[(recv_kind, dst_stage, a.microbatch)] = t
            return
        self.comm.send(t, self.mapping[dst_stage], self._tag(a.kind, a.stage, a.microbatch),
                       f"{what} of stage {a.stage} microbatch {a.microbatch} (step {self.step})")
        self.times.comm_s += time.perf_counter() - t0

    def _recv(self, a: Action, src_stage: int, what: str) -> None:
        if self.mapping[src_stage] == self.rank:
            return  # handed over by _send on this rank
        t0 = time.perf_counter()
        tag_stage = src_stage if a.kind is Kind.RECV_ACT else a.stage + 1
        send_kind = Kind.SEND_ACT if a.kind is Kind.RECV_ACT else Kind.SEND_GRAD
        self.inbox[(a.kind, a.stage, a.microbatch)] = self.comm.recv(
            self.act_shape, torch.float32, self.device.torch_device, self.mapping[src_stage],
            self._tag(send_kind, tag_stage, a.microbatch),
            f"{what} for stage {a.stage} microbatch {a.microbatch} (step {self.step})")
        self.times.comm_s += time.perf_counter() - t0

    def _send_act(self, a: Action) -> None:
        self._send(a, a.stage + 1, "activation")

    def _send_grad(self, a: Action) -> None:
        self._send(a, a.stage - 1, "input gradient")

    def _recv_act(self, a: Action) -> None:
        self._recv(a, a.stage - 1, "activation")

    def _recv_grad(self, a: Action) -> None:
        self._recv(a, a.stage + 1, "output gradient")
