"""Activation modes on one rank with 4 stages: recompute, keep and selective give the same losses and weights bit
for bit (dropout, accumulation, fp32 and bf16), and the device peak grows by what keep holds."""

from __future__ import annotations

import itertools

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.errors import ConfigError, PipelineError
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.runtime.activations import StageMode, parts_of, stage_modes
from mobiuspipe.startup.config_plan import plan_for_config


@pytest.fixture
def runs(act_runs):
    """The activation_runs helper module."""
    return act_runs


@pytest.fixture
def rotated(monkeypatch, runs):
    """Stages change arena slot between forward and backward; released slots are filled with NaNs."""
    from mobiuspipe.memory.arena import DeviceArena

    monkeypatch.setattr(DeviceArena, "acquire", DeviceArena.acquire)
    monkeypatch.setattr(DeviceArena, "release", DeviceArena.release)
    monkeypatch.setattr(DeviceArena, "__init__", DeviceArena.__init__)
    runs.rotate_slots(DeviceArena)


def _same(a, b) -> bool:
    return (
        a.losses == b.losses
        and a.weights.keys() == b.weights.keys()
        and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    )


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_every_mode_trains_bit_identical(runs, rotated, precision):
    cfg = runs.config(precision=precision)
    plan = plan_for_config(cfg)
    assert [len(s.layers) for s in plan.stages] == [3, 3, 3, 3]  # room for kept-recomputed-kept stages
    base = runs.run(cfg, "recompute", steps=2)
    assert base.losses[-1] != runs.run(cfg, "recompute", steps=2, p=0.0).losses[-1]  # the dropout masks matter
    for name, activations in runs.choices(plan).items():
        if name != "recompute":
            assert _same(runs.run(cfg, activations, steps=2), base), name


def test_the_weight_references_are_what_keeps_it_right(runs, rotated, monkeypatch):
    """Without WeightRefs the kept graphs read the slot their forward used, which holds other weights by B."""
    cfg = runs.config(accumulation=1)
    base = runs.run(cfg, "recompute", steps=2)
    assert _same(runs.run(cfg, "keep", steps=2), base)
    monkeypatch.setattr("mobiuspipe.runtime.activations._weight_ref", lambda t, slot: None)
    assert runs.run(cfg, "keep", steps=2).losses != base.losses


def _saved_bytes(runs, cfg, plan) -> int:
    """Per microbatch, the bytes autograd saves in the forward of every stage but the last (parameters left
    out), measured on the plain layers: what keep holds beyond recompute."""
    torch.manual_seed(0)
    mods = [make() for make in runs.layers(cfg)]
    params = {p.untyped_storage().data_ptr() for m in mods for p in m.parameters()}
    x: torch.Tensor = torch.randint(0, cfg.model.vocab_size, (plan.microbatch_size, cfg.model.seq_len))
    total = 0
    for s in plan.stages[:-1]:
        ledger, n = DeviceLedger(), itertools.count()

        def pack(t: torch.Tensor, ledger=ledger, n=n) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                ledger.hold(("saved", next(n)), t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x.detach().requires_grad_() if x.is_floating_point() else x
            for l in s.layers:
                h = mods[l](h)
        total += ledger.bytes
        x = h.detach()
    return total


def test_the_device_peak_grows_by_the_kept_activations(runs):
    cfg = runs.config(accumulation=1)
    plan = plan_for_config(cfg)
    runs_by = {name: runs.run(cfg, runs.choices(plan)[name], steps=2) for name in ("recompute", "first", "keep")}
    peak = {name: max(r.peaks) for name, r in runs_by.items()}
    assert peak["recompute"] < peak["first"] < peak["keep"]
    kept = plan.num_microbatches * _saved_bytes(runs, cfg, plan)  # every microbatch of stages 0..2 at B of stage 3
    assert runs_by["keep"].parts["kept"] == pytest.approx(kept, rel=0.05)
    assert peak["keep"] - peak["recompute"] == pytest.approx(kept, rel=0.15)
    assert "kept" not in runs_by["recompute"].parts


def test_selective_without_kept_layers_holds_what_recompute_holds(runs):
    cfg = runs.config(accumulation=1)
    plan = plan_for_config(cfg)
    assert runs.run(cfg, runs.choices(plan)["none"], steps=1).peaks == runs.run(cfg, "recompute", steps=1).peaks


def test_parts_are_maximal_runs():
    sel = StageMode("selective", frozenset({4, 5, 8}))
    assert [(p.layers, p.kept) for p in parts_of(range(3, 9), sel)] == [
        ((3,), False),
        ((4, 5), True),
        ((6, 7), False),
        ((8,), True),
    ]
    assert [(p.layers, p.kept) for p in parts_of([0, 1], StageMode("keep"))] == [((0, 1), True)]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("fast", "expected one of recompute, keep, selective"),
        ("selective", "needs the layers to keep"),
        ({7: "keep"}, "names stage 7"),
        ({1: ("selective", [0])}, "keeps layers [0], but stage 1 has layers 3..5"),
        ({1: ("keep", [3])}, "expected 'recompute', 'keep' or ('selective'"),
        (["keep"], "must be 'recompute', 'keep' or a dict"),
    ],
)
def test_bad_activations_are_refused(runs, spec, message):
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace("[", r"\[")):
        stage_modes(spec, plan_for_config(runs.config()))


def test_memory_activations_config_key(runs):
    base = runs.config().to_dict()
    cfg = config_from_dict({**base, "memory": {"activations": "keep"}})
    assert cfg.memory.activations == "keep"
    with pytest.raises(ConfigError, match="activations"):
        config_from_dict({**base, "memory": {"activations": "selective"}})
    with Pipeline(runs.layers(cfg), lm_loss, plan=plan_for_config(cfg), memory=cfg.memory) as pipe:
        assert sorted(pipe.engine.parts) == [0, 1, 2]  # every stage keeps, but the last (fused F and B)
