"""The step report: TensorBoard events equal metrics.jsonl, evaluations, ETA, per-rank figures, model FLOPs and MFU."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
import torch

from mobiuspipe.models.gpt import build_layers
from mobiuspipe.pipeline import StepResult
from mobiuspipe.run.flops import flops_per_token, peak_tflops, rate
from mobiuspipe.run.metrics import Reporter, step_metrics
from mobiuspipe.run.usage import RankStep, folder_bytes, host_rss_bytes
from mobiuspipe.runtime.engine import StepTimes
from partition.spec.models import ModelSpec

STEP_S = (1.0, 0.5, 0.7, 0.6)
"""Rank 0's wall time of each step."""


def _ranks(step: int) -> list[RankStep]:
    own = RankStep(STEP_S[step], 0.3, 0.01 * step, 0.1, 1000 + step, 300 << 20, None)
    other = RankStep(STEP_S[step] + 0.01, 0.4, 0.02, 0.05, 2000, 310 << 20, 4096 * (step + 1))
    return [own, other]


def _result(step: int) -> StepResult:
    return StepResult(
        step=step,
        loss=5.0 - step,
        times=StepTimes(0.4, 0.02 + step, 0.1),
        arena_peak_bytes=3 << 20,
        arena_budget_bytes=4 << 20,
        loss_scale=1024.0,
        skipped=step == 1,
        device_peak_bytes=2000,
    )


def _run_reporter(tmp_path, stream) -> None:
    with Reporter(steps=4, log_every=1, out_dir=str(tmp_path), stream=stream) as report:
        for s in range(3):
            report(step_metrics(_result(s), 1e-3 * (s + 1), _ranks(s), 512, 2e9, [0.05, 0.05]))
        report.eval(2, 2.5)


def test_events_equal_metrics_jsonl(tmp_path, read_events):
    (tmp_path / "events.out.tfevents.1.old.0").write_bytes(b"")  # an earlier run's: removed
    _run_reporter(tmp_path, io.StringIO())
    events = read_events(tmp_path)  # every tag's values checked against metrics.jsonl
    train = {"loss", "lr", "tokens_per_s", "tflops", "mfu", "eta_s", "loss_scale", "skipped"}
    own = {"step_s", "compute_s", "load_s", "comm_s", "device_peak_bytes", "host_rss_bytes"}
    assert set(events) == (
        {f"train/{k}" for k in train}
        | {f"time/{k}" for k in ("step_s", "compute_s", "load_s", "comm_s")}
        | {f"memory/{k}" for k in ("device_peak_bytes", "arena_peak_bytes", "host_rss_bytes", "ssd_bytes")}
        | {f"rank0/{k}" for k in own}
        | {f"rank1/{k}" for k in own | {"ssd_bytes"}}
        | {"eval/loss", "eval/perplexity"}
    )
    assert events["train/loss"] == [(0, 5.0), (1, 4.0), (2, 3.0)]
    assert events["train/skipped"] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert [v for _, v in events["train/eta_s"]] == pytest.approx([0.5 * 2, 0.6 * 1])  # step 0 has none
    assert events["eval/perplexity"] == [(2, pytest.approx(math.exp(2.5)))]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_records_say_what_they_are(tmp_path):
    _run_reporter(tmp_path, io.StringIO())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 0), ("train", 1), ("train", 2), ("eval", 2)]
    first = rows[0]
    assert first["step_s"] == 1.0 and first["tokens_per_s"] == 512.0  # rank 0's wall time
    assert first["compute_s"] == 0.4 and first["ranks"][0]["compute_s"] == 0.3  # largest vs rank 0's own
    assert first["flops_per_step"] == 2e9 and first["tflops"] == pytest.approx(2e-3)
    assert first["mfu"] == pytest.approx(2e-3 / 0.1)
    assert first["host_rss_bytes"] == 310 << 20 and first["ssd_bytes"] == 4096  # max; sum over ranks with a store
    assert rows[-1] == {"kind": "eval", "step": 2, "loss": 2.5, "perplexity": pytest.approx(math.exp(2.5))}


def test_the_line_shows_eta_rate_and_memory_of_one_rank_or_says_max():
    out = io.StringIO()
    report = Reporter(steps=4, log_every=1, out_dir=None, stream=out)
    for s in range(3):
        report(step_metrics(_result(s), 1e-3, _ranks(s), 512, 2e9, [0.05, 0.05]))
    report.eval(2, 2.5)
    lines = out.getvalue().splitlines()
    assert "ETA" not in lines[0] and "ETA 0:00:01" in lines[1]
    assert "1,024 tok/s  0.004 TFLOPS MFU 4%" in lines[1]
    assert "step 500 ms (rank 0: compute 300 / load 10 / comm 100)" in lines[1]
    assert "max over 2 ranks: device peak 1.95 KiB, arena peak 3.00 of 4.00 MiB, host RSS 310.00 MiB" in lines[1]
    assert lines[1].endswith("; ssd 8.00 KiB in all  scale 1024  (overflow: step skipped)")
    assert lines[0].startswith("step 0 [1/4]  loss 5.0000") and lines[2].startswith("step 2 [3/4]  ")
    assert lines[3] == "eval after step 2: loss 2.5000  perplexity 12.18"  # the step number of its record


def test_the_console_shows_the_step_numbers_of_the_records(tmp_path):
    """A reader matching a console line to its metrics.jsonl record finds the same step number in both."""
    out = io.StringIO()
    with Reporter(steps=3, log_every=1, out_dir=str(tmp_path), stream=out) as report:
        report.eval(-1, 4.0)
        for s in range(3):
            report(step_metrics(_result(s), None, _ranks(s), 512, 2e9, [0.05, 0.05]))
            report.eval(s, 3.0 - s)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("eval before training: ") and rows[0] == {**rows[0], "kind": "eval", "step": -1}
    for line, row in zip(lines[1:], rows[1:]):
        shown = line.split()[1] if row["kind"] == "train" else line.split(":")[0].split()[-1]
        assert int(shown) == row["step"], (line, row)
    assert lines[1].startswith("step 0 [1/3]  ") and lines[-1].startswith("eval after step 2: ")


def test_without_the_ranks_figures_the_line_says_max_and_shows_the_grad_norm():
    """StepMetrics built without gathered figures: StepResult's largest parts; a clipped run's norm shows."""
    r = dataclasses.replace(_result(1), grad_norm=0.8125)
    m = step_metrics(r, 1e-3, _ranks(1), 512, 2e9, [0.05, 0.05])
    line = dataclasses.replace(m, ranks=()).line(4)
    assert "step 500 ms (max over ranks: compute 400 / load 1020 / comm 100)" in line
    assert "lr 0.001  grad norm 0.812  " in line and m.record()["grad_norm"] == 0.8125
    assert "grad norm" not in step_metrics(_result(1), 1e-3, _ranks(1), 512, 2e9, [0.05, 0.05]).line(4)


def test_an_eval_during_the_bar_starts_a_new_line():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    with Reporter(steps=4, log_every=1, out_dir=None, stream=out) as report:
        report(step_metrics(_result(0), None, _ranks(0), 512, 2e9, [None, 0.05]))
        report.eval(0, 3000.0)
    assert out.getvalue().endswith("\neval after step 0: loss 3000.0000  perplexity inf\n")
    assert "MFU" not in out.getvalue()  # a device the hardware table does not know


def test_no_event_files_without_tensorboard(tmp_path):
    with Reporter(steps=1, log_every=1, out_dir=str(tmp_path), stream=None, tensorboard=False) as report:
        report(step_metrics(_result(0), None, _ranks(0), 512, 2e9, [0.05, 0.05]))
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_flops_per_token_is_6n_plus_attention():
    spec = ModelSpec("t", num_blocks=3, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
    layers = build_layers(spec, 0)
    matmul = sum(
        m.weight.numel() for l in layers.values() for m in l.modules() if isinstance(m, torch.nn.Linear)
    )  # the N of 6N: every matmul weight (blocks and head), no biases, norms or embedding tables
    L, h, s = 3, 16, 8
    assert matmul == L * 12 * h * h + h * 32
    assert flops_per_token(spec) == 6 * matmul + 12 * L * s * h + 6 * h


def test_rate_against_the_hardware_table():
    assert peak_tflops("cpu-standin") == 0.05 and peak_tflops("RTX 4090") == 165.2
    assert peak_tflops("no such gpu") is None
    assert rate(1e12, 2.0, [0.05, 0.05]) == (0.5, pytest.approx(5.0))
    assert rate(1e12, 2.0, [0.05, None]) == (0.5, None)


def test_host_rss_and_folder_bytes(tmp_path):
    assert host_rss_bytes() > 10 << 20  # this process holds torch
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 50_000)  # not directly in the folder: not counted
    assert 10_000 <= folder_bytes(str(tmp_path)) < 50_000


def test_a_resumed_run_keeps_the_earlier_records_and_replaces_the_later(tmp_path, read_events):
    """A run that crashed after step 3 resumes at step 2 (its checkpoint): metrics.jsonl keeps steps 0-1 (and the
    eval after step 1), drops the rest, and TensorBoard shows the resumed run's values from step 2 on."""
    with Reporter(steps=4, log_every=1, out_dir=str(tmp_path), stream=None) as report:
        for s in range(4):
            report(step_metrics(_result(s), 1e-3, _ranks(s), 512, 2e9, [0.05, 0.05]))
            if s == 1:
                report.eval(s, 3.0 - s)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "st')  # a line torn by the crash
    with Reporter(steps=4, log_every=1, out_dir=str(tmp_path), stream=None, first_step=2) as report:
        for s in range(2, 4):
            report(step_metrics(dataclasses.replace(_result(s), loss=9.0 + s), 1e-3, _ranks(s), 512, 2e9, [0.05]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["loss"]) for r in rows] == [
        ("train", 0, 5.0),
        ("train", 1, 4.0),
        ("eval", 1, 2.0),
        ("train", 2, 11.0),
        ("train", 3, 12.0),
    ]
    events = read_events(tmp_path)  # each tag's points equal metrics.jsonl's: the first run's steps 2-3 are gone
    assert events["train/loss"] == [(0, 5.0), (1, 4.0), (2, 11.0), (3, 12.0)]
