"""A Hugging Face GPT-2 whose tied embedding table is split over two ranks (the embedding's stage on one, the
head's on the other), trained with 2 accumulation passes and gradient clipping, resumes with --resume auto from
the checkpoint its run wrote mid-run (in the background, while the next step ran): the losses, gradient norms
and final weights of the resumed steps equal the uninterrupted run's bit for bit (fp32)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from partition.plan import load_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

T = 17
"""seq_len of these runs."""
STEPS = 4
CUT = 2
"""The checkpoint the second run resumes from (steps done)."""


def _config(folder: Path, src: Path, write_config) -> Path:
    folder.mkdir()
    return write_config(
        folder,
        {
            "model": {"hf": str(src / "model"), "seq_len": T},
            "data": {"tokens": str(src / "train.bin"), "batch_size": 4, "num_microbatches": 2},
            "train": {
                "steps": STEPS,
                "lr": 0.004,
                "lr_schedule": "cosine",
                "warmup_steps": 1,
                "seed": 2,
                "precision": "fp32",
                "accumulation_steps": 2,
                "max_grad_norm": 0.3,
                "out_dir": str(folder / "out"),
                "checkpoint_every": CUT,
                "tensorboard": False,
            },
            "plan": {"num_gpus": 2, "num_stages": 4, "mapping": "cross"},
        },
    )


def _torchrun(cfg: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "mobiuspipe.train", "--config", str(cfg), "--resume", "auto"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _result(out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((out / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return [r for r in records if r["kind"] == "train"], weights


def test_tied_halves_on_two_ranks_resume_bit_identically(tmp_path, launch, hf_kit):
    write_config, _ = launch
    src = tmp_path / "src"
    hf_kit.save_model("gpt2", src / "model", seed=11)
    ids = np.random.default_rng(4).integers(0, hf_kit.VOCAB, 23 * T + 1).astype(np.uint16)
    ids.tofile(src / "train.bin")  # 23 sequences: shuffled epochs of 8-sequence steps wrap mid-step

    whole = _config(tmp_path / "whole", src, write_config)
    proc = _torchrun(whole)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = load_plan(whole.parent / "out" / "plan.yaml")
    assert plan.mapping[0] != plan.mapping[-1]  # the tied table's halves on different ranks

    cut = _config(tmp_path / "cut", src, write_config)
    checkpoints = cut.parent / "out" / "checkpoints"
    shutil.copytree(whole.parent / "out" / "checkpoints" / f"step-{CUT}", checkpoints / f"step-{CUT}")
    proc = _torchrun(cut)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step-{CUT}'} at step {CUT}" in proc.stdout

    (want, want_w), (got, got_w) = _result(whole.parent / "out"), _result(cut.parent / "out")
    assert [r["step"] for r in got] == list(range(CUT, STEPS))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want[CUT:]]
    assert all(r["grad_norm"] > 0.3 for r in want)  # the clipping acted on every step
    assert got_w.keys() == want_w.keys()
    for k in want_w:
        assert torch.equal(got_w[k], want_w[k]), k
    head = f"{plan.num_layers - 1}.lm_head.weight"
    assert torch.equal(got_w["0.wte.weight"], got_w[head])  # the two copies of the tied table stay one
