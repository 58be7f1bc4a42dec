"""Whole runs under MOBIUSPIPE_STRICT=1 (the stand-ins as strict as CUDA and NCCL) finish and equal the same run
on lax stand-ins and plain PyTorch, bit for bit where the arithmetic is the same."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mobiuspipe.config import load_config

pytestmark = pytest.mark.slow


def _run(tmp_path, launch, strict: str, monkeypatch, **train) -> tuple[list[dict], dict[str, torch.Tensor]]:
    write_config, torchrun = launch
    folder = tmp_path / f"strict{strict}"
    folder.mkdir()
    (folder / "held_out.txt").write_text("held-out text the pipeline evaluates on, stage by stage. " * 8)
    cfg = write_config(
        folder,
        {
            "model": {"num_blocks": 4, "d_model": 24, "num_heads": 3, "seq_len": 19},
            "data": {"batch_size": 6, "num_microbatches": 3, "eval_path": str(folder / "held_out.txt")},
            "train": {"steps": 3, "lr": 0.01, "seed": 3, "precision": "fp32", "out_dir": str(folder / "out"), **train},
            "plan": {"num_gpus": 2, "num_stages": 6, "mapping": "round-robin"},
            "runtime": {"comm_timeout_s": 20},
        },
    )
    monkeypatch.setenv("MOBIUSPIPE_STRICT", strict)
    proc = torchrun(cfg, 2, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((folder / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return records, weights


def test_six_stages_on_two_ranks_with_evaluation(tmp_path, launch, reference, monkeypatch):
    """Mapping [0,1,0,1,0,1] with 3 microbatches: rank 0 posts the sends of stage 0 while rank 1 sends stage 1's
    first output back, the shape that hangs NCCL on one queue per pair."""
    strict, strict_weights = _run(tmp_path, launch, "1", monkeypatch)
    lax, lax_weights = _run(tmp_path, launch, "0", monkeypatch)
    assert [(r["kind"], r["step"], r["loss"]) for r in strict] == [(r["kind"], r["step"], r["loss"]) for r in lax]
    assert any(r["kind"] == "eval" for r in strict)
    assert strict_weights.keys() == lax_weights.keys()
    assert all(torch.equal(strict_weights[k], lax_weights[k]) for k in lax_weights)
    ref_losses, ref_weights = reference(load_config(tmp_path / "strict1" / "run.yaml"))
    assert [r["loss"] for r in strict if r["kind"] == "train"] == pytest.approx(ref_losses, rel=1e-5)
    for k, w in ref_weights.items():
        torch.testing.assert_close(strict_weights[k], w, rtol=1e-5, atol=1e-6, msg=k)


HEADER_SPY = """
import os
if "RANK" in os.environ:  # a rank (its exit skips atexit: the file is written as it goes)
    from mobiuspipe.runtime import engine
    from mobiuspipe.runtime.peers import comm

    sent, real = [], comm.Comm.send_spec
    path = os.path.join(os.environ["HEADER_SPY"], "rank" + os.environ["RANK"])

    def send_spec(self, spec, device, dst, tag, what):
        if tag >= engine.EVAL_TAG_BASE:
            sent.append(tag)
            with open(path, "w") as f:
                f.write(repr(sent))
        return real(self, spec, device, dst, tag, what)

    comm.Comm.send_spec = send_spec
"""


def test_evaluation_sends_each_messages_shape_once_a_batch_shape(tmp_path, launch, monkeypatch):
    """Evaluation sent a shape header before every activation between ranks, on NCCL a host wait on each side;
    as training does, it now learns the shapes at a batch shape's first evaluation batch and sends none after (the
    run evaluates after each of 3 steps, several batches each, all of one shape)."""
    import sys

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(HEADER_SPY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "inject"), *sys.path]))
    monkeypatch.setenv("HEADER_SPY", str(tmp_path))
    records, _ = _run(tmp_path, launch, "1", monkeypatch, eval_every=1)
    assert sum(r["kind"] == "eval" for r in records) >= 3
    sent = [eval((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert [len(tags) for tags in sent] == [9, 6]  # stages 0, 2, 4 and 1, 3 send 3 microbatches each, once
    assert all(len(set(tags)) == len(tags) for tags in sent)


def _hf_run(tmp_path, launch, hf_kit, strict: str, monkeypatch) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A tied GPT-2 (its table's halves on two ranks), 2 accumulation passes, 4 stages, cross mapping."""
    write_config, torchrun = launch
    folder = tmp_path / f"hf-strict{strict}"
    hf_kit.save_model("gpt2", folder / "model", seed=7)
    ids = np.random.default_rng(3).integers(0, hf_kit.VOCAB, 40 * 17 + 1).astype(np.uint16)
    ids.tofile(folder / "train.bin")
    cfg = write_config(
        folder,
        {
            "model": {"hf": str(folder / "model"), "seq_len": 17},
            "data": {"tokens": str(folder / "train.bin"), "shuffle": False, "batch_size": 8, "num_microbatches": 4},
            "train": {
                "steps": 2,
                "lr": 0.004,
                "seed": 2,
                "precision": "fp32",
                "out_dir": str(folder / "out"),
                "accumulation_steps": 2,
            },
            "plan": {"num_gpus": 2, "num_stages": 4, "mapping": "cross"},
            "runtime": {"comm_timeout_s": 30},
        },
    )
    monkeypatch.setenv("MOBIUSPIPE_STRICT", strict)
    proc = torchrun(cfg, 2, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((folder / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return losses, weights


def test_tied_hf_gpt2_with_two_passes_equals_the_lax_run(tmp_path, launch, hf_kit, monkeypatch):
    """The tied exchange (both ranks send first: the shape that hangs NCCL on one queue per pair) under strict
    equals the lax run bit for bit (test_hf_train_mp checks the same run against transformers under strict)."""
    strict, strict_weights = _hf_run(tmp_path, launch, hf_kit, "1", monkeypatch)
    lax, lax_weights = _hf_run(tmp_path, launch, hf_kit, "0", monkeypatch)
    assert strict == lax and len(strict) == 2
    assert strict_weights.keys() == lax_weights.keys()
    assert all(torch.equal(strict_weights[k], lax_weights[k]) for k in lax_weights)
