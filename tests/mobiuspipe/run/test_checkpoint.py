"""Checkpoints: a run resumed from step k continues bit-identically (losses and weights equal the uninterrupted
run's) in fp32, bf16 and fp16, with states in host memory or on SSD, with dropout; a damaged, unfinished or
foreign checkpoint is a named error and the ones before it stay usable."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

STEPS = 5


def _cfg(precision: str, blocks: int = 3):
    return config_from_dict(
        {
            "model": {"num_blocks": blocks, "d_model": 24, "num_heads": 3, "seq_len": 17},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": STEPS, "lr": 0.01, "weight_decay": 0.05, "seed": 5, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )


def _pipeline(cfg, memory, optimizer=None):
    t = cfg.train
    opt = optimizer or partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    scaler = LossScaler(scale=2.0**20, growth_interval=2) if t.precision == "fp16" else None
    layers = layer_factories(model_spec(cfg), t.seed)
    block = layers[1]
    layers[1] = lambda: nn.Sequential(block(), nn.Dropout(0.2))  # its masks come from the saved random state
    return Pipeline(
        layers,
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=opt,
        memory=memory,
        loss_scaler=scaler,
    )


def _steps(pipe, data, steps) -> list:
    out = []
    for s in steps:
        pipe.set_lr(0.01 * (1 - s / 10))  # a schedule: the resumed run must be at the same place in it
        out.append((pipe.train_batch(*data.batch(s, 6)).loss, pipe.scaler.scale if pipe.scaler else None))
    return out


def _memory(tier: str, folder) -> MemoryConfig | None:
    if tier == "host":
        return None
    weights = "ssd" if tier == "ssd-all" else "host"
    return MemoryConfig(
        optimizer="ssd", weights=weights, ssd_dir=str(folder), host_budget_mb=0.25 if tier == "ssd-all" else 1.0
    )


@pytest.mark.parametrize(
    "precision,tier",
    [("fp32", "host"), ("bf16", "host"), ("fp16", "host"), ("fp32", "ssd"), ("bf16", "ssd-all")],
)
def test_a_resumed_run_continues_bit_identically(tmp_path, precision, tier):
    torch.set_num_threads(1)
    cfg = _cfg(precision)
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    torch.manual_seed(7)
    with _pipeline(cfg, _memory(tier, tmp_path / "a")) as pipe:
        first = _steps(pipe, data, range(2))
        folder = pipe.save_checkpoint(tmp_path / "ckpt")  # the Pipeline's own, as users call it
        rest = _steps(pipe, data, range(2, STEPS))
        want = pipe.state_dict()
    torch.manual_seed(123)  # the resumed run's random state comes from the checkpoint
    with _pipeline(cfg, _memory(tier, tmp_path / "b")) as pipe:
        assert pipe.load_checkpoint(folder) == 2
        again = _steps(pipe, data, range(2, STEPS))
        got = pipe.state_dict()
    assert again == rest and len(first) == 2
    torch.manual_seed(7)
    with _pipeline(cfg, _memory(tier, tmp_path / "c")) as pipe:  # writing a checkpoint changes nothing
        assert _steps(pipe, data, range(STEPS)) == first + rest
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_keep_and_latest(tmp_path):
    cfg = _cfg("fp32")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None
    with _pipeline(cfg, None) as pipe:
        for s in range(4):
            _steps(pipe, data, [s])
            save_checkpoint(pipe, root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-3", "step-4"]
    (root / "step-9").mkdir()  # a folder without its `complete` marker does not count
    assert latest_checkpoint(root) == root / "step-4"
    head = json.loads((root / "step-4" / "complete").read_text())
    assert head["step"] == 4 and head["world_size"] == 1 and list(head["files"]) == ["rank0.safetensors"]


def test_damaged_unfinished_or_foreign_checkpoints_are_named(tmp_path):
    cfg = _cfg("fp32")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    root = tmp_path / "ckpt"
    with _pipeline(cfg, None) as pipe:
        _steps(pipe, data, [0])
        old = save_checkpoint(pipe, root, keep=3)
        _steps(pipe, data, [1])
        new = save_checkpoint(pipe, root, keep=3)
    f = new / "rank0.safetensors"
    f.write_bytes(f.read_bytes()[:-7])  # truncated
    with _pipeline(cfg, None) as pipe:
        with pytest.raises(CheckpointError, match=r"rank0.safetensors is corrupted \(expected \d+ bytes"):
            load_checkpoint(pipe, new)
        assert load_checkpoint(pipe, old) == 1  # the one before stays usable
    f.unlink()
    with _pipeline(cfg, None) as pipe, pytest.raises(CheckpointError, match="rank0.safetensors is missing"):
        load_checkpoint(pipe, new)
    (new / "complete").write_text('{"step": 2}')  # a marker of the right JSON without its keys
    with _pipeline(cfg, None) as pipe, pytest.raises(CheckpointError, match="lacks world_size, plan, files"):
        load_checkpoint(pipe, new)
    (new / "complete").unlink()
    with _pipeline(cfg, None) as pipe, pytest.raises(CheckpointError, match="no `complete` marker"):
        load_checkpoint(pipe, new)
    with _pipeline(_cfg("fp32", blocks=4), None) as pipe:
        with pytest.raises(CheckpointError, match=r"is of another model or plan \(model: checkpoint 'gpt-3x24'"):
            load_checkpoint(pipe, old)


def test_train_checks_the_resume_folder_before_launching(tmp_path):
    import subprocess
    import sys

    (tmp_path / "run.yaml").write_text(f"train: {{out_dir: {tmp_path / 'out'}}}\n")
    (tmp_path / "out" / "checkpoints" / "step-4").mkdir(parents=True)  # never finished: no `complete`
    for given, found in (("step-4", "a folder without its `complete` marker"), ("step-9", "no folder")):
        out = subprocess.run(
            [sys.executable, "-m", "mobiuspipe", "train", "--config", str(tmp_path / "run.yaml")]
            + ["--resume", str(tmp_path / "out" / "checkpoints" / given)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "launching" not in out.stderr, out.stderr
        assert (
            "train.resume: expected a checkpoint folder (OUT_DIR/checkpoints/step-N holding `complete`) or a run "
            f"folder holding checkpoints/, found {found}" in out.stderr
        )


def test_a_checkpoint_of_other_data_or_batches_is_named(tmp_path):
    """The loop stores run_identity (seed, data file name and size, batches) in `complete` and checks it."""
    from mobiuspipe.run.resume import run_identity

    cfg = _cfg("fp32")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    run = run_identity(cfg)
    assert run["data"] == "sample.txt" and run["data_bytes"] > 0 and run["seed"] == 5
    with _pipeline(cfg, None) as pipe:
        _steps(pipe, data, [0])
        folder = save_checkpoint(pipe, tmp_path / "ckpt", keep=1, run=run)
    other = run | {"seed": 6, "batch_size": 12}
    with _pipeline(cfg, None) as pipe:
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(pipe, folder, other)
        assert load_checkpoint(pipe, folder, run) == 1
    assert "was made with other data or batches (seed: checkpoint 5, this run 6; batch_size: checkpoint 6" in str(
        e.value
    )


def test_the_run_identity_tells_a_changed_data_folder_field_or_split(tmp_path):
    """A datasets folder re-exported under the same name, or another data.field, data.split, data.format or
    data.token_dtype, gives other sequences: a resume would go on with other data, repeating some sequences and
    never reaching others. The identity tells them apart; a checkpoint whose identity predates a key still resumes."""
    import dataclasses

    from mobiuspipe.checkpoint import _check_run
    from mobiuspipe.run.resume import run_identity

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "data-00000-of-00001.arrow").write_bytes(b"x" * 100)
    cfg = _cfg("fp32")
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=str(folder), tokenizer=str(tmp_path / "tok"))
    )
    first = run_identity(cfg)
    (folder / "data-00000-of-00001.arrow").write_bytes(b"x" * 120)  # the same name, other content
    assert run_identity(cfg) != first
    for change in ({"field": "body"}, {"split": "test"}, {"format": "instruction"}, {"token_dtype": "uint32"}):
        assert run_identity(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **change))) != first, change
    older = {k: v for k, v in first.items() if k in ("seed", "data", "data_bytes", "shuffle", "seq_len")}
    _check_run(older, first, tmp_path)  # no word on what the older checkpoint did not record


@pytest.mark.parametrize("tier", ["ssd", "ssd-all"])
def test_the_ssd_store_does_not_grow_with_the_checkpoints(tmp_path, tier):
    """A checkpoint hard-links the store's records; the next write of each goes to a new file and the store's name
    for the old one waited for a flush of the store, which came only at close: once pruning removed the
    checkpoint, those files stayed, one copy of the SSD states a checkpoint (a week's run filled its disk)."""
    import os

    cfg = _cfg("bf16" if tier == "ssd-all" else "fp32")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    files = []
    with _pipeline(cfg, _memory(tier, tmp_path / "store")) as pipe:
        assert pipe.store is not None
        for s in range(12):
            pipe.train_batch(*data.batch(s, 6))
            if s % 3 == 2:
                save_checkpoint(pipe, tmp_path / "ckpt", keep=2)
                files.append(sorted(os.listdir(pipe.store.folder)))
    assert len(files[3]) == len(files[1]), (files[1], files[3])  # one generation awaiting its reap, no more
