"""The measured trace of chosen steps (mobiuspipe.runtime.action_trace): every action of a traced step once, in the
schedule's order and inside the step's span; nothing for other steps; the same numbers as an untraced run; the
Chrome file; the config key's checks."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import ConfigError
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.action_trace import ActionTrace, TracedAction, as_sim_result, chrome, write_chrome
from mobiuspipe.startup.config_plan import plan_for_config


def _train(runs, cfg, trace_steps=()):
    """(losses, weights, the pipeline's trace, its schedule) of 3 steps of the dropout GPT of activation_runs."""
    t = cfg.train
    torch.manual_seed(t.seed)
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    rows = t.accumulation_steps * cfg.data.batch_size
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    with Pipeline(
        runs.layers(cfg),
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=opt,
        accumulation_steps=t.accumulation_steps,
        trace_steps=trace_steps,
    ) as pipe:
        losses = [pipe.train_batch(*data.batch(step, rows)).loss for step in range(3)]
        return losses, pipe.state_dict(), pipe.trace, [str(a) for a in pipe.engine.schedule]


def _name(r: TracedAction) -> str:
    return f"{r.kind}{r.stage}" + (f".{r.microbatch}" if r.microbatch >= 0 else "")


def test_a_traced_step_records_each_action_once_in_order_and_changes_nothing(act_runs):
    cfg = act_runs.config(accumulation=1)
    losses, weights, trace, schedule = _train(act_runs, cfg, trace_steps=[1])
    base_losses, base_weights, untraced, _ = _train(act_runs, cfg)
    assert losses == base_losses and all(torch.equal(weights[k], base_weights[k]) for k in weights)
    assert untraced.records == []
    assert {r.step for r in trace.records} == {1}
    actions = [r for r in trace.records if r.kind not in ("step", "flush", "U")]
    assert [_name(r) for r in actions] == schedule  # every action once, as the engine ran them
    assert all(a.end_s >= a.start_s for a in trace.records)
    assert all(b.start_s >= a.end_s for a, b in zip(actions, actions[1:]))  # one after the other
    (step,) = [r for r in trace.records if r.kind == "step"]
    assert all(step.start_s <= r.start_s and r.end_s <= step.end_s for r in actions)
    # each stage's host update ran once, after its offload (it may end after the step: it overlaps the next)
    offloads = {r.stage: r for r in actions if r.kind == "O"}
    updates = {r.stage: r for r in trace.records if r.kind == "U"}
    assert updates.keys() == offloads.keys() == {0, 1, 2, 3}
    assert all(updates[j].start_s >= offloads[j].start_s for j in updates)


def test_chrome_events_per_rank_from_the_earliest_record(tmp_path):
    a = [TracedAction(3, "F", 0, 1, 10.0, 10.002), TracedAction(3, "U", 0, -1, 10.003, 10.004)]
    b = [TracedAction(3, "RA", 1, 1, 10.001, 10.0025)]
    events = chrome(a, 0, 10.0)
    assert [(e["name"], e["tid"], e["pid"]) for e in events] == [("F0.1", "compute", 0), ("U0", "copy", 0)]
    assert events[0]["ts"] == 0.0 and events[0]["dur"] == pytest.approx(2000.0)
    doc = json.loads(write_chrome([a, b], tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"]) for e in xs] == [
        ("F0.1", 0, "compute"),
        ("U0", 0, "copy"),
        ("RA1.1", 1, "comm"),
    ]
    assert xs[2]["ts"] == pytest.approx(1000.0)
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"] == ["rank 0", "rank 1"]


def test_trace_wants_only_its_steps():
    trace = ActionTrace([2, 5])
    assert [s for s in range(7) if trace.wants(s)] == [2, 5]
    trace.add(2, "F", 0, 0, 1.0, 1.5)
    assert trace.records == [TracedAction(2, "F", 0, 0, 1.0, 1.5)]


@pytest.mark.parametrize(
    "train,runtime,expected",
    [
        ({"steps": 4, "out_dir": "out"}, {"trace_steps": [4]}, "steps below train.steps (4)"),
        ({"steps": 4}, {"trace_steps": [1]}, "a train.out_dir"),
        ({"steps": 4, "out_dir": "out"}, {"trace_steps": [-1]}, "each >= 0"),
    ],
)
def test_trace_steps_are_checked(train, runtime, expected):
    with pytest.raises(ConfigError, match="trace_steps") as e:
        config_from_dict({"train": train, "runtime": runtime})
    assert expected in str(e.value)


def test_a_traced_step_as_the_simulators_result():
    """The actions the simulator also has (F, B, loads, offloads, updates), from the step's first record; the
    messages and releases are left out but count in the step's span."""
    rank0 = [
        TracedAction(4, "L", 0, -1, 10.000, 10.001),
        TracedAction(4, "F", 0, 0, 10.001, 10.003),
        TracedAction(4, "SA", 0, 0, 10.003, 10.0031),
        TracedAction(4, "O", 0, -1, 10.009, 10.0095),
        TracedAction(4, "U", 0, -1, 10.0095, 10.012),
        TracedAction(5, "F", 0, 0, 11.0, 11.002),  # another step
    ]
    rank1 = [TracedAction(4, "RA", 1, 0, 10.0005, 10.004), TracedAction(4, "B", 1, 0, 10.004, 10.008)]
    r = as_sim_result([rank0, rank1], 4)
    assert [(k, g, j, i) for k, g, j, i, _, _ in r.events] == [
        ("load", 0, 0, -1),
        ("F", 0, 0, 0),
        ("B", 1, 1, 0),
        ("offload", 0, 0, -1),
        ("update", 0, 0, -1),
    ]
    assert r.events[1][4:] == pytest.approx((0.001, 0.003))
    assert r.step_time_s == pytest.approx(0.012) and r.compute_busy_s == pytest.approx((0.002, 0.004))
    assert r.link_model == "measured"
    with pytest.raises(ValueError, match="no rank traced step 6"):
        as_sim_result([rank0, rank1], 6)


def test_the_run_draws_the_last_traced_step_that_ran(tmp_path, capsys):
    """Steps [2, 9] asked, the run stopped after step 5: step 2 is drawn; with no traced step run, nothing is."""
    from types import SimpleNamespace

    from mobiuspipe.run.train import _write_trace

    def pipe(records):
        trace = ActionTrace([2, 9])
        trace.records = records
        info = SimpleNamespace(world_size=1)
        return SimpleNamespace(wait_updates=lambda: None, info=info, rank=0, trace=trace)

    _write_trace(pipe([TracedAction(2, "F", 0, 0, 1.0, 1.5)]), tmp_path)  # type: ignore[arg-type]
    assert "step 2 as it ran: 500.0 ms" in (tmp_path / "trace.svg").read_text()
    assert capsys.readouterr().out.startswith("mobiuspipe: the actions of steps [2] are in ")
    (tmp_path / "trace.svg").unlink()
    _write_trace(pipe([]), tmp_path)  # type: ignore[arg-type]
    assert not (tmp_path / "trace.svg").exists() and (tmp_path / "trace.json").exists()
    assert "steps [] are in" in capsys.readouterr().out
