"""`mobiuspipe profile --refine RUN_DIR --profile FILE` against a run folder made by hand: the plan the run
followed and a trace whose computations ran 1.5x (stage 0's forward 2x) what the plan predicted."""

from __future__ import annotations

import random

import pytest

from mobiuspipe.profiling.refine import loop_seconds
from mobiuspipe.runtime.action_trace import TracedAction, read_chrome, write_chrome
from partition.plan import load_plan, save_plan
from partition.rules.tiers import HostBudget
from partition.search import make_plan, predict_step
from partition.spec.profile import LayerProfile, Profile, load_profile, save_profile
from tests.mobiuspipe.cli.test_cli_profile import run
from topology import cpu_standin


def _profile(n: int, seed: int) -> Profile:
    rng = random.Random(seed)

    def layer(k: int) -> LayerProfile:
        f = rng.uniform(0.5e-3, 3e-3)
        return LayerProfile(f"l{k}", 50 + k, 200 + 4 * k, 4000, 64, 0.0, 0.0, f, 2 * f, recompute_s=f, kept_s=f)

    return Profile("toy", "cpu-standin", "fp32", 2, 1, tuple(layer(k) for k in range(n)), input_bytes=32)


@pytest.fixture
def run_dir(tmp_path):
    """tmp_path/out: plan.yaml and trace.json of a 2-rank run of 4 stages, steps 0-2 traced (step 0 10x slower,
    as a first step that learns the messages' shapes is: left out), each message sent 0.4 ms and taken 0.6 ms after
    that, each step started on rank 0 every 10 s; tmp_path/profile.yaml its profile."""
    profile = _profile(9, 0)
    plan = make_plan(profile, cpu_standin(2, 1 << 30), 3, num_stages=4, mapping="cross", solver="dp")
    assert plan.layout is not None
    sim = predict_step(plan, plan.layout, HostBudget(None, "unlimited")).sim
    per_rank: list[list[TracedAction]] = [[], []]
    for step in (0, 1, 2):
        per_rank[0].append(TracedAction(step, "step", -1, -1, 10.0 * step - 0.25, 10.0 * step + 5))
        for kind, gpu, stage, mb, start, end in sim.events:
            if kind in ("F", "B"):
                k = (2.0 if (kind, stage) == ("F", 0) else 1.5) * (10.0 if step == 0 else 1.0)
                t0 = 10.0 * step + start
                per_rank[gpu].append(TracedAction(step, kind, stage, mb, t0, t0 + k * (end - start)))
                if kind == "F" and stage < 3:
                    per_rank[gpu].append(TracedAction(step, "SA", stage, mb, t0 + 1, t0 + 1.0004))
                    per_rank[1 - gpu].append(TracedAction(step, "RA", stage + 1, mb, t0 + 1.0002, t0 + 1.001))
    out = tmp_path / "out"
    out.mkdir()
    save_plan(plan, out / "plan.yaml")
    write_chrome(per_rank, out / "trace.json")
    save_profile(profile, tmp_path / "profile.yaml")
    return tmp_path


def test_the_refined_profile_scales_each_stages_layers(run_dir):
    argv = ["profile", "--refine", str(run_dir / "out"), "--profile", str(run_dir / "profile.yaml")]
    code, out, err = run([*argv, "-o", str(run_dir / "r.yaml")])
    assert code == 0, err
    base, got = load_profile(run_dir / "profile.yaml"), load_profile(run_dir / "r.yaml")
    stage0 = load_plan(run_dir / "out" / "plan.yaml").stages[0].layers
    for l, (a, b) in enumerate(zip(base.layers, got.layers)):
        f = 2.0 if l in stage0 else 1.5
        assert (b.fwd_s, b.kept_s) == (pytest.approx(f * a.fwd_s, rel=1e-5), pytest.approx(f * a.keep_s, rel=1e-5))
        assert (b.bwd_s, b.recompute_s) == (
            pytest.approx(1.5 * a.bwd_s, rel=1e-5),
            pytest.approx(1.5 * a.redo_s, rel=1e-5),
        )
    assert "stage 0: F x2.00, B x1.50" in out
    assert "traced steps [1, 2]" in out
    assert "posting a message to another rank: 0.400 ms" in out
    assert "taking a message from another rank: 0.600 ms" in out  # from the send's end (1.0004) to the receive's


def test_layout_out_writes_the_runs_machine_with_its_message_costs(run_dir):
    from partition.rules.tiers import HostBudget
    from partition.search import predict_step
    from topology import load_topology

    out = run_dir / "out"
    machine = run_dir / "machine.yaml"
    argv = ["profile", "--refine", str(out), "--profile", str(run_dir / "profile.yaml")]
    code, text, err = run([*argv, "--layout-out", str(machine)])
    assert code == 0, err
    assert f"layout written to {machine}" in text
    plan = load_plan(out / "plan.yaml")
    got = load_topology(str(machine))
    assert plan.layout is not None and got.measured is not None
    assert (got.measured.message_send_s, got.measured.message_recv_s) == (
        pytest.approx(0.0004, rel=1e-3),
        pytest.approx(0.0006, rel=1e-3),
    )
    assert got.measured.step_overhead_s == pytest.approx(loop_seconds(read_chrome(out / "trace.json"), [1, 2]))
    assert f"the training loop between steps: {got.measured.step_overhead_s * 1e3:.3f} ms a step" in text
    assert got.gpus == plan.layout.gpus  # the same machine, with what the run measured added
    # the costs it holds lengthen the plan's predicted step
    budget = HostBudget(None, "unlimited")
    assert predict_step(plan, got, budget).sim.step_time_s > predict_step(plan, plan.layout, budget).sim.step_time_s
    code, text, err = run([*argv, "--layout-out", str(run_dir / "machine.txt")])
    assert code == 2 and "expected one of ['.yaml', '.yml', '.json']" in err and not (run_dir / "machine.txt").exists()
    code, text, _ = run(argv)
    assert code == 0 and "--layout-out FILE writes them" in text


def test_layout_out_keeps_a_cost_the_run_did_not_measure(tmp_path):
    import dataclasses

    from mobiuspipe.cli.profile import _write_layout
    from mobiuspipe.profiling.refine import Refinement
    from topology import load_topology
    from topology.types import Measured

    probed = Measured(host_cores=1.5, message_latency_s=1e-4, message_send_s=3e-4, message_recv_s=5e-4)
    layout = dataclasses.replace(cpu_standin(2, 1 << 30), measured=probed)
    refined = Refinement(_profile(3, 0), (), send_s=2e-4, recv_s=None, step_overhead_s=7e-3)
    _write_layout(layout, refined, str(tmp_path / "m.yaml"))
    got = load_topology(str(tmp_path / "m.yaml")).measured
    # the probes and the unmeasured receive stay; the send and the loop's overhead are the run's
    assert got == dataclasses.replace(probed, message_send_s=2e-4, step_overhead_s=7e-3)
    code, _, err = run(["profile", "--model", "gpt3-125m", "--layout-out", str(tmp_path / "x.yaml")])
    assert code == 2 and "give --refine RUN_DIR too" in err


@pytest.mark.parametrize(
    "change, needles",
    [
        (lambda d: (d / "out" / "trace.json").unlink(), ["no trace.json", "runtime.trace_steps"]),
        (
            lambda d: save_profile(_profile(8, 0), d / "profile.yaml"),
            ["8 layers", "9", "the profile the plan was made from"],
        ),
    ],
)
def test_a_folder_that_is_not_a_traced_run_or_another_models_profile_is_named(run_dir, change, needles):
    change(run_dir)
    argv = ["profile", "--refine", str(run_dir / "out"), "--profile", str(run_dir / "profile.yaml")]
    code, out, err = run(argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err


def test_refine_without_a_profile_names_what_is_missing(run_dir):
    code, _, err = run(["profile", "--refine", str(run_dir / "out")])
    assert code == 2 and "followed a plan file, so give --profile FILE" in err
    code, _, err = run(["profile", "--refine", str(run_dir / "out"), "--model", "gpt3-125m"])
    assert code == 2 and "drop --model" in err
    code, _, err = run(["profile"])
    assert code == 2 and "profile needs --model NAME (or --refine RUN_DIR" in err
    code, _, err = run(["profile"])
    assert code == 2 and "--model" in err


def test_partition_config_plans_from_a_given_profile_of_its_model(tmp_path):
    import contextlib
    import dataclasses
    import io
    import json

    from mobiuspipe import cli
    from mobiuspipe.config import load_config
    from mobiuspipe.startup.config_plan import gpt_profile

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text("train: {precision: fp32}\ndata: {num_microbatches: 4}\n")
    base = gpt_profile(load_config(str(cfg_path)))
    slow = dataclasses.replace(
        base,
        layers=tuple(
            dataclasses.replace(x, fwd_s=3 * x.fwd_s, bwd_s=3 * x.bwd_s, recompute_s=3 * x.redo_s, kept_s=3 * x.keep_s)
            for x in base.layers
        ),
    )
    save_profile(slow, tmp_path / "slow.yaml")
    save_profile(_profile(5, 0), tmp_path / "other.yaml")

    def partition(*extra: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["partition", "--config", str(cfg_path), "--json", *extra])
        return code, out.getvalue(), err.getvalue()

    plain, slowed = partition(), partition("--profile", str(tmp_path / "slow.yaml"))
    assert plain[0] == 0 and slowed[0] == 0, (plain[2], slowed[2])
    a, b = json.loads(plain[1])["predicted_step_time_s"], json.loads(slowed[1])["predicted_step_time_s"]
    assert 2.0 < b / a <= 3.0 + 1e-9
    code, out, err = partition("--profile", str(tmp_path / "other.yaml"))
    assert code == 2 and out == "" and "is a profile of model 'toy' (5 layers)" in err
