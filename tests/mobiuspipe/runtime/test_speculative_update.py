"""The speculative update: with clipping or fp16, each stage's host update starts as soon as its gradients are
offloaded, assuming no clipping and no overflow, and keeps what it overwrote until the step's norm and overflow check
are known; then it stands, or is rolled back and redone (or dropped). The weights must be bit for bit those of the
update that waits for the whole backward, with states in host memory and on the SSD, in fp32, bf16 and fp16; and
the updates must really start during the backward."""

from __future__ import annotations

import dataclasses
import statistics
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam
from mobiuspipe.optim.undo import StepUndo
from mobiuspipe.startup.config_plan import model_spec, plan_for_config
from tests.mobiuspipe.runtime.update_runs import BATCH, STEPS, update_config


def _cfg(precision: str, memory: MemoryConfig | None = None):
    return update_config(precision, memory, seed=5)


def _run(cfg, clip: float | None, speculative: bool, scaler: LossScaler | None = None, trace=()):
    """(each step's (loss, grad norm, skipped, updates rolled back), the weights after the last, the trace)."""
    torch.set_num_threads(1)
    t = cfg.train
    pipe = Pipeline(
        layer_factories(model_spec(cfg), t.seed),
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay),
        memory=cfg.memory,
        max_grad_norm=clip,
        loss_scaler=scaler,
        speculative_update=speculative,
        trace_steps=trace,
    )
    with pipe:
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        results = [pipe.train_batch(*data.batch(s, BATCH)) for s in range(STEPS)]
        steps = [(r.loss, repr(r.grad_norm), r.skipped, r.updates_rolled_back) for r in results]  # repr: nan == nan
        return steps, pipe.state_dict(), list(pipe.trace.records)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _clip_between(cfg) -> float:
    """A max_grad_norm that clips some of the run's steps and not others (the median of its unclipped norms)."""
    steps, _, _ = _run(cfg, 1e9, speculative=False)
    return statistics.median(float(n) for _, n, _, _ in steps)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_speculative_update_gives_the_held_updates_bits_whether_it_stands_or_is_redone(precision, tmp_path):
    cfg = _cfg(precision)
    clip = _clip_between(cfg)
    held, held_w, _ = _run(cfg, clip, speculative=False)
    spec, spec_w, _ = _run(cfg, clip, speculative=True)
    assert [s[:3] for s in spec] == [s[:3] for s in held]
    assert _same(spec_w, held_w)
    clipped = [float(n) > clip for _, n, _, _ in held]
    assert any(clipped) and not all(clipped)
    assert [r > 0 for *_, r in spec] == _redone(clipped)  # a clipped step redoes its updates, the others stand
    assert all(r == 0 for *_, r in held)
    for ssd in _on_ssd(cfg, tmp_path):
        on_ssd, ssd_w, _ = _run(ssd, clip, speculative=True)
        assert [s[:3] for s in on_ssd] == [s[:3] for s in held]
        assert [r > 0 for *_, r in on_ssd] == _redone(clipped)
        assert _same(ssd_w, held_w)


def _redone(failed: list[bool]) -> list[bool]:
    """Which steps roll their updates back, given which clip or overflow: those that speculated (the first, and each
    after a step that did neither) and failed."""
    return [f and (s == 0 or not failed[s - 1]) for s, f in enumerate(failed)]


def _on_ssd(cfg, tmp_path):
    """cfg with its optimizer states on the SSD, then with its weights and gradients streamed from there too."""
    for weights in ("host", "ssd"):
        folder = tmp_path / weights
        memory = MemoryConfig(optimizer="ssd", weights=weights, ssd_dir=str(folder), host_budget_mb=4)
        yield dataclasses.replace(cfg, memory=memory)


def test_fp16_overflowed_steps_drop_their_speculative_updates_bit_for_bit(tmp_path):
    """Scales that overflow the first two steps: their tentative updates are undone (no weight, moment or step count
    changes); the clipped steps after redo theirs."""

    def scaler():
        return LossScaler(scale=2.0**40, backoff_factor=2.0**-12, growth_interval=2)

    cfg = _cfg("fp16")
    held, held_w, _ = _run(cfg, 0.05, speculative=False, scaler=scaler())
    spec, spec_w, _ = _run(cfg, 0.05, speculative=True, scaler=scaler())
    assert [s[2] for s in held] == [True, True, False, False, False, False]
    assert [s[:3] for s in spec] == [s[:3] for s in held]
    assert [r > 0 for *_, r in spec] == _redone([True] * STEPS)  # every step fails: only the first speculates
    assert _same(spec_w, held_w)
    for ssd in _on_ssd(cfg, tmp_path):
        on_ssd, ssd_w, _ = _run(ssd, 0.05, speculative=True, scaler=scaler())
        assert [s[:3] for s in on_ssd] == [s[:3] for s in held]
        assert _same(ssd_w, held_w)


def test_speculative_updates_start_during_the_backward():
    """Traced: with clipping that never triggers, the last stage's update ends before the first stage's last backward
    starts (held, every update starts after the whole backward)."""
    cfg = _cfg("fp32")

    def updates_before_last_backward(speculative: bool) -> int:
        _, _, events = _run(cfg, 1e9, speculative=speculative, trace=(3,))
        last_b = max(r.start_s for r in events if r.kind == "B")
        return sum(1 for r in events if r.kind == "U" and r.end_s < last_b)

    assert updates_before_last_backward(True) >= 2
    assert updates_before_last_backward(False) == 0


def test_step_undo_restores_an_optimizer_bit_for_bit_even_its_first_step():
    g = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(37, generator=g))
    out = torch.randn(37, generator=g).bfloat16()
    opt = torch.optim.AdamW([p], lr=0.1)
    undo = StepUndo()
    for first in (True, False):
        before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}, out.clone())
        undo.save(opt, p, (out,))
        p.grad = torch.randn(37, generator=g)
        opt.param_groups[0]["lr"] = 0.5
        opt.step()
        out.copy_(p.detach())
        undo.restore()
        assert torch.equal(p.detach(), before[0]) and torch.equal(out, before[2])
        assert opt.param_groups[0]["lr"] == 0.1
        assert (len(opt.state[p]) == 0) == first
        assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
        opt.step()  # a real step, so that the second round has states to restore
    with pytest.raises(RuntimeError, match="nothing is kept"):
        undo.restore()


def test_an_out_of_core_tentative_step_commits_to_the_plain_steps_bits_or_rolls_back_to_none(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = {"a": torch.randn(3000, generator=g), "b": torch.randn(77, generator=g)}
    grads = [{k: torch.randn(v.numel(), generator=g) for k, v in w.items()} for _ in range(3)]

    def make(folder):
        store = SSDStore(folder)
        return store, OutOfCoreAdam.create(store, w, lr=0.01, host_budget_bytes=64 << 10, slots=3)

    (s1, plain), (s2, spec) = make(tmp_path / "plain"), make(tmp_path / "spec")
    with s1, s2:
        for gr in grads:
            plain.step(gr)
            before = spec.read_state()
            spec.step(gr, tentative=True)
            with pytest.raises(RuntimeError, match="not settled"):
                spec.step(gr)
            spec.roll_back()
            after = spec.read_state()
            assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
            spec.step(gr, tentative=True)
            spec.commit()
            assert spec.step_count == plain.step_count
        a, b = plain.read_state(), spec.read_state()
        assert all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])
        with pytest.raises(RuntimeError, match="no tentative step"):
            spec.commit()


def test_steps_before_a_delayed_update_speculate_and_the_run_keeps_its_bits():
    """delayed_update 3: steps 0 and 1 speculate (step 2's update is left to step 3), the rest are delayed."""
    cfg = _cfg("bf16")
    clip = _clip_between(cfg)

    def run(speculative: bool):
        torch.set_num_threads(1)
        t = cfg.train
        with Pipeline(
            layer_factories(model_spec(cfg), t.seed),
            lm_loss,
            plan=plan_for_config(cfg),
            optimizer=partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay),
            max_grad_norm=clip,
            delayed_update=3,
            speculative_update=speculative,
        ) as pipe:
            data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
            results = [pipe.train_batch(*data.batch(s, BATCH)) for s in range(STEPS)]
            return [(r.loss, r.grad_norm, r.updates_rolled_back) for r in results], pipe.state_dict()

    (held, held_w), (spec, spec_w) = run(False), run(True)
    assert [s[:2] for s in spec] == [s[:2] for s in held]
    assert _same(spec_w, held_w)
    assert [r > 0 for *_, r in spec[2:]] == [False] * (STEPS - 2)  # no speculation from step 2 on
    assert [r > 0 for *_, r in spec[:2]] == _redone([(n or 0.0) > clip for _, n, _ in held[:2]])


def test_the_policy_says_which_steps_speculate_and_what_they_keep_in_memory():
    from mobiuspipe.startup.update_policy import UpdatePolicy
    from partition.rules.placement import HostCopies

    clip = UpdatePolicy(checked=True)
    assert clip.holds(0) and clip.speculates(0) and clip.copies == HostCopies(1, undo=True)
    assert not clip.speculates(1, last_passed=False)  # after a step that clipped or overflowed
    assert not UpdatePolicy(checked=False).holds(0) and UpdatePolicy(checked=False).copies == HostCopies()
    assert not UpdatePolicy(checked=True, speculative=False).speculates(0)
    assert not UpdatePolicy(checked=True, overlap=False).speculates(0)
    late = UpdatePolicy(checked=True, delayed_update=3)
    assert [late.speculates(s) for s in range(5)] == [True, True, False, False, False]
    assert late.copies == HostCopies(2, undo=True)
    assert UpdatePolicy(checked=True, delayed_update=1).copies == HostCopies(2, undo=False)
