"""The out-of-core AdamW: SSD-resident states streamed through a small host budget must step exactly like
the in-memory CPUAdam (same kernel, same bits) and like torch.optim.AdamW in float64; resume and faults."""

from __future__ import annotations

import errno

import pytest
import torch

from mobiuspipe import _ext
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam, plan_groups

SHAPES = {"emb": (37, 29), "one": (1,), "seven": (7,), "odd": (1023,), "over": (1025,), "big": (100_003,)}
BUDGET = 4 * 12 * 8192  # 4 slots of 8192 elements: "big" spans 13 groups, small ones share a group
IMPLS = [pytest.param("c", marks=pytest.mark.skipif(not _ext.HAVE_C, reason="C++ extension not built")), "torch"]


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _grads(gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for n, s in SHAPES.items():
        scale = 10 ** torch.empty(s).uniform_(-3, 1, generator=gen)
        out[n] = (torch.randn(s, generator=gen) * scale).to(dtype)
    return out


def _store(tmp_path, name="job", backend=None) -> SSDStore:
    """The default engine (io_uring where allowed: the slots become registered buffers) unless named."""
    return SSDStore(tmp_path / name, backend=backend, queue_depth=8, block_bytes=1 << 16)


def test_groups_cover_every_element_once():
    numels = [("a", 5), ("b", 20), ("c", 3), ("d", 16)]
    groups = plan_groups(numels, 8)
    assert [sum(s.numel for s in g) for g in groups] == [8, 8, 8, 8, 8, 4]
    seen = {n: [] for n, _ in numels}
    for g in groups:
        ends = sorted((s.group_off, s.group_off + s.numel) for s in g)
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[0][0] == 0  # packed, no gaps
        for s in g:
            seen[s.name].extend(range(s.param_off, s.param_off + s.numel))
    assert all(seen[n] == list(range(k)) for n, k in numels)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("pipelined", [True, False])
def test_equals_in_memory_adamw(tmp_path, impl, grad_dtype, wd, pipelined):
    backend = None if pipelined else ("threads" if _ext.HAVE_C else "python")
    params = _params()
    refs = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    exact = torch.optim.AdamW([torch.nn.Parameter(p.double()) for p in params.values()], lr=1e-2, weight_decay=wd)
    mem = CPUAdam(list(refs.values()), lr=1e-2, weight_decay=wd, impl=impl)
    gen = torch.Generator().manual_seed(1)
    with _store(tmp_path, backend=backend) as store:
        opt = OutOfCoreAdam.create(store, params, lr=1e-2, weight_decay=wd, host_budget_bytes=BUDGET, impl=impl)
        assert len(opt.groups) > len(opt.slots)  # the pipeline really cycles its slots
        for _ in range(3):
            grads = _grads(gen, grad_dtype)
            outs = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
            opt.step(grads, outs, pipelined=pipelined)
            mem.step_fused({}, grads={refs[n]: grads[n] for n in grads})
            for p, g in zip(exact.param_groups[0]["params"], grads.values()):
                p.grad = g.double()
            exact.step()
        state = opt.read_state()
    for (n, r), x in zip(refs.items(), exact.param_groups[0]["params"]):
        assert torch.equal(state[n]["param"], r.detach()), n  # bit for bit
        assert torch.equal(state[n]["exp_avg"], mem.state[r]["exp_avg"]), n
        assert torch.equal(state[n]["exp_avg_sq"], mem.state[r]["exp_avg_sq"]), n
        assert torch.equal(outs[n], r.detach().bfloat16()), n
        torch.testing.assert_close(
            state[n]["param"].double(), x.detach(), rtol=1e-6, atol=1e-6 * float(x.detach().abs().max())
        )


def test_resume_after_flush_continues_the_same_run(tmp_path):
    params, gen_a, gen_b = _params(2), torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with _store(tmp_path, "straight") as store:
        opt = OutOfCoreAdam.create(store, params, lr=3e-3, host_budget_bytes=BUDGET)
        for i in range(4):
            opt.lr = 3e-3 if i < 2 else 1e-3  # a schedule
            opt.step(_grads(gen_a, torch.float32))
        straight = opt.read_state()
    with _store(tmp_path, "resumed") as store:
        opt = OutOfCoreAdam.create(store, params, lr=3e-3, host_budget_bytes=BUDGET)
        for _ in range(2):
            opt.step(_grads(gen_b, torch.float32))
        opt.lr = 1e-3  # the schedule moved on before the checkpoint
        opt.flush()
    with _store(tmp_path, "resumed") as store:
        opt = OutOfCoreAdam.open(store, host_budget_bytes=BUDGET, slots=3)
        assert opt.step_count == 2 and opt.lr == 1e-3
        for _ in range(2):
            opt.step(_grads(gen_b, torch.float32))
        resumed = opt.read_state()
    assert all(torch.equal(resumed[n][k], straight[n][k]) for n in params for k in resumed[n])


def test_a_failed_read_stops_the_step_and_the_optimizer(tmp_path):
    with _store(tmp_path) as store:
        opt = OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        gen = torch.Generator().manual_seed(4)
        opt.step(_grads(gen, torch.float32))
        store.engine.inject_fault(5, errno.EIO)
        with pytest.raises(SwapIOError, match="EIO"):
            opt.step(_grads(gen, torch.float32))
        assert store.engine.pending() == 0  # every read and write-back of the step was waited for
        with pytest.raises(RuntimeError, match="step 2 .* failed .* restore the folder from a copy"):
            opt.step(_grads(gen, torch.float32))
        with pytest.raises(RuntimeError, match="some groups on disk took the step and others did not"):
            opt.flush()  # no checkpoint of half-stepped states
    with _store(tmp_path) as store:  # nor a resume of them after a restart
        with pytest.raises(RuntimeError, match="step 2 .* failed"):
            OutOfCoreAdam.open(store, host_budget_bytes=BUDGET)


def test_states_restored_after_a_failed_step_open_again(tmp_path):
    """write_state (a restore from a copy) mends what a failed step broke: the optimizer steps again, and after a
    flush the store opens, where the failed step's mark in the store's metadata outlived the restore."""
    with _store(tmp_path) as store:
        opt = OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        gen = torch.Generator().manual_seed(4)
        opt.step(_grads(gen, torch.float32))
        saved = opt.read_state()
        store.engine.inject_fault(5, errno.EIO)
        with pytest.raises(SwapIOError, match="EIO"):
            opt.step(_grads(gen, torch.float32))
        opt.write_state(saved, 1)
        opt.step(_grads(gen, torch.float32))
        opt.flush()
        stepped = opt.read_state()
    with _store(tmp_path) as store:
        opt = OutOfCoreAdam.open(store, host_budget_bytes=BUDGET)
        assert opt.step_count == 2
        again = opt.read_state()
        assert all(torch.equal(again[n][k], stepped[n][k]) for n in stepped for k in stepped[n])


def test_a_corrupted_group_is_caught_on_the_next_step(tmp_path):
    with _store(tmp_path) as store:
        opt = OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        store.flush()
        path = tmp_path / "job" / store.info("adam/g000003").file
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\x7f")
        with pytest.raises(SwapIOError, match="checksum mismatch reading tensor 'adam/g000003'"):
            opt.step(_grads(torch.Generator().manual_seed(0), torch.float32))


def test_argument_checks(tmp_path):
    with _store(tmp_path) as store:
        with pytest.raises(ValueError, match="too small for 4 slots: it needs at least 49152 bytes"):
            OutOfCoreAdam.create(store, _params(), host_budget_bytes=1000)
        with pytest.raises(ValueError, match="slots must be >= 3"):
            OutOfCoreAdam.create(store, _params(), slots=2)
        with pytest.raises(KeyError, match="no optimizer under 'adam'"):
            OutOfCoreAdam.open(store)
        opt = OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        with pytest.raises(ValueError, match="already holds an optimizer"):
            OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        grads = _grads(torch.Generator().manual_seed(0), torch.float32)
        with pytest.raises(ValueError, match=r"missing \['big'\]"):
            opt.step({n: g for n, g in grads.items() if n != "big"})
        with pytest.raises(ValueError, match="gradient of 'one' must be .* 1 elements"):
            opt.step({**grads, "one": torch.ones(2)})
        with pytest.raises(ValueError, match="weights output of 'seven'"):
            opt.step(grads, {"seven": torch.empty(7, dtype=torch.int32)})
        with pytest.raises(ValueError, match="over host_budget_bytes"):
            OutOfCoreAdam.open(store, host_budget_bytes=BUDGET // 2)
        assert opt.step_count == 0  # nothing ran


def test_fp32_weights_out_equal_the_stored_master(tmp_path):
    with SSDStore(tmp_path / "job") as store:
        opt = OutOfCoreAdam.create(store, _params(), host_budget_bytes=BUDGET)
        outs = {n: torch.empty(p.shape) for n, p in _params().items()}
        opt.step(_grads(torch.Generator().manual_seed(3), torch.bfloat16), outs)
        state = opt.read_state()
        for n, out in outs.items():
            assert torch.equal(out, state[n]["param"]), n
