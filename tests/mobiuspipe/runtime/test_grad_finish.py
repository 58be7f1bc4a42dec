"""A stage's offloaded gradients are finished on the host (the add of an accumulated pass, clipping's squared norm,
fp16's finiteness) off the compute thread, as soon as their copy has ended. On CUDA the compute thread issues the
copy and runs on; had it to finish them, it would wait for the copy and then read the stage's whole host gradient
(a read of host memory's bandwidth per stage, at the step's end for the norm) while the gpu waits for its next
kernels."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.device import Device
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.runtime.states import HostStates, host_grads
from tests.mobiuspipe.runtime.update_runs import BATCH, update_config, update_pipeline

PASSES = 3


class _Threads:
    """The threads that ran each kind of work on the host gradients."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {}
        self.grads: set[int] = set()  # the storages of the host gradient buffers

    def note(self, what: str) -> None:
        self.seen.setdefault(what, set()).add(threading.get_ident())

    def counted(self, what, fn):
        def spy(*args, **kwargs):
            self.note(what)
            return fn(*args, **kwargs)

        return spy


def _spy(monkeypatch, threads: _Threads) -> None:
    for name in ("sum_of_squares", "all_finite"):
        monkeypatch.setattr(host_grads, name, threads.counted(name, getattr(host_grads, name)))
    add_ = torch.Tensor.add_

    def spied_add_(self, *args, **kwargs):
        if self.untyped_storage().data_ptr() in threads.grads:
            threads.note("add into the gradients")
        return add_(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "add_", spied_add_)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_host_gradients_are_finished_off_the_compute_thread(monkeypatch, clip):
    torch.set_num_threads(1)
    cfg = update_config("fp16")
    t = cfg.train
    pipe = update_pipeline(cfg, max_grad_norm=clip, loss_scaler=LossScaler(scale=2.0**8), accumulation_steps=PASSES)
    threads = _Threads()
    with pipe:
        tiers = [s.states for s in pipe.stages.values()]
        assert all(isinstance(t, HostStates) for t in tiers)
        threads.grads = {t.grads.untyped_storage().data_ptr() for t in tiers if isinstance(t, HostStates)}
        _spy(monkeypatch, threads)
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        results = [pipe.train_batch(*data.batch(s, PASSES * BATCH)) for s in range(2)]
    compute = threading.get_ident()
    want = {"add into the gradients", "sum_of_squares" if clip else "all_finite"}  # with the norm: isfinite(norm)
    assert want <= threads.seen.keys(), threads.seen.keys()
    on_compute = sorted(what for what, ids in threads.seen.items() if compute in ids)
    assert not on_compute, f"{on_compute} ran on the compute thread"
    assert not any(r.skipped for r in results)


def _fp16(g: torch.Generator, n: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, generator=g) * scale).to(torch.float16)


@pytest.mark.parametrize("norm", [False, True])
def test_the_finished_norm_and_finiteness_are_those_of_the_accumulated_gradients(norm):
    """Three passes of odd length added in fp16 as the passes come: the norm is the float64 sum of the squares of the
    fp16 sums; a pass that overflows (finite halves whose sum is not: 60000 + 60000) is seen, and so is a tied half
    added after the finishing whose sum overflows; a single pass's, reduced on the gpu, alike."""
    device = Device(0, use_cuda=False)
    g = torch.Generator().manual_seed(11)
    n = 4099
    states = HostStates(torch.zeros(n), torch.float16, device.pin, partial(CPUAdam))
    states.make_accumulation_buffer()
    passes = [_fp16(g, n) for _ in range(PASSES)]
    for k, part in enumerate(passes):
        last = k == PASSES - 1
        states.take_grads(device.to_device(part), device, accumulate=k > 0, norm=last and norm, finite=last)
    want = passes[0] + passes[1] + passes[2]
    assert torch.equal(states.grad_slice(0, n), want)
    assert states.grad_sumsq() == (pytest.approx(float(want.double().square().sum()), rel=1e-12) if norm else 0.0)
    assert states.grads_finite()
    tied = torch.full((3,), 40000.0, dtype=torch.float16)
    states.add_grads(100, tied)  # a tied half: x + 40000 is finite
    assert states.grads_finite()
    states.add_grads(100, tied)  # x + 80000 is not
    assert not states.grads_finite()

    big = torch.full((n,), 60000.0, dtype=torch.float16)
    states.take_grads(device.to_device(big), device, finite=True)
    states.take_grads(device.to_device(big), device, accumulate=True, norm=norm, finite=True)
    assert not states.grads_finite()

    one = _fp16(g, n, 100.0)  # a step's only pass: reduced on the gpu, and a tied half's add seen the same
    states.take_grads(device.to_device(one), device, norm=norm, finite=True)
    assert float(states.grad_sumsq()) == (pytest.approx(float(one.double().square().sum()), rel=1e-12) if norm else 0)
    assert bool(states.grads_finite())
    states.add_grads(7, torch.full((2,), 30000.0, dtype=torch.float16))  # |x| < 2000: finite
    assert bool(states.grads_finite())
    states.add_grads(7, torch.full((2,), 40000.0, dtype=torch.float16))  # x + 70000 is not
    assert not bool(states.grads_finite())
    device.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_single_pass_steps_checks_reduce_the_slot_on_the_gpu(monkeypatch, clip):
    """With one pass a step, the gradients the host tier receives are the slot's as they are: their squared norm and
    finiteness are reduced on the gpu before the copy (in stream order after the backward), and read with the other
    stages' at once. The host neither waits for the copy (the first stage's, the step's last, ends after the
    backward) nor reads the stage's whole host gradient for them (a pass over host memory a stage, on the
    finisher's thread: the first stage's lay between the backward's end and a clipped or fp16 step's updates)."""
    torch.set_num_threads(1)
    cfg = update_config("fp16")
    t = cfg.train
    pipe = update_pipeline(cfg, max_grad_norm=clip, loss_scaler=LossScaler(scale=2.0**8))
    threads = _Threads()
    settled = []
    with pipe:
        _spy(monkeypatch, threads)
        settle = host_grads.HostGrads.settle
        monkeypatch.setattr(host_grads.HostGrads, "sumsq", _noting(settled, host_grads.HostGrads.sumsq, settle))
        monkeypatch.setattr(
            host_grads.HostGrads, "all_finite", _noting(settled, host_grads.HostGrads.all_finite, settle)
        )
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        results = [pipe.train_batch(*data.batch(s, BATCH)) for s in range(2)]
    assert not {"sum_of_squares", "all_finite"} & threads.seen.keys(), threads.seen.keys()
    assert not any(settled), "a gradient check waited for a gradient's copy"
    assert not any(r.skipped for r in results) and all((r.grad_norm is None) == (clip is None) for r in results)


def _noting(settled: list[bool], check, settle):
    """check, noting in `settled` whether it waited for a take's finishing (HostGrads.settle)."""

    def spy(self, *args, **kwargs):
        waited = []
        original = self.settle
        self.settle = lambda *a, **k: waited.append(True) or original(*a, **k)
        try:
            return check(self, *args, **kwargs)
        finally:
            del self.settle
            settled.append(bool(waited))

    return spy
