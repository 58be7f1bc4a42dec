"""A checkpoint resumes under other state tiers than it was written with (memory.optimizer changed between runs, or
`auto` placing a stage elsewhere under another host budget): the resumed steps equal the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.config import MemoryConfig
from mobiuspipe.data.dataset import open_data
from tests.mobiuspipe.run.test_checkpoint import _cfg, _pipeline, _steps

TIERS = ("host", "device", "ssd")


def _memory(tier: str, folder) -> MemoryConfig | None:
    if tier == "host":
        return None
    if tier == "device":
        return MemoryConfig(optimizer="device")
    return MemoryConfig(optimizer="ssd", ssd_dir=str(folder), host_budget_mb=1.0)


@pytest.mark.parametrize("to", ["host", "device"])
def test_states_saved_from_the_ssd_store_resume_in_memory(tmp_path, to):
    _resumes_across(tmp_path, "ssd", to)


@pytest.mark.parametrize("saved, to", [(a, b) for a in ("host", "device") for b in TIERS if a != b])
def test_states_saved_from_memory_resume_under_another_tier(tmp_path, saved, to):
    _resumes_across(tmp_path, saved, to)


def _resumes_across(tmp_path, saved: str, to: str) -> None:
    """The states load as they were saved, bit for bit; the first resumed step's loss is the uninterrupted run's;
    where both tiers update alike (CPUAdam's kernel, in memory or out of core) the resumed run is that run."""
    cfg = _cfg("bf16")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    torch.manual_seed(7)
    with _pipeline(cfg, _memory(saved, tmp_path / "a")) as pipe:
        _steps(pipe, data, range(2))
        folder = pipe.save_checkpoint(tmp_path / "ckpt")
        states = _states(pipe)
        rest = _steps(pipe, data, range(2, 4))
        weights = pipe.state_dict()
    with _pipeline(cfg, _memory(to, tmp_path / "b")) as pipe:
        pipe.load_checkpoint(folder)
        assert _states(pipe) == states
        again = _steps(pipe, data, range(2, 4))
        resumed = pipe.state_dict()
    assert again[0] == rest[0]
    if "device" not in (saved, to):  # torch's AdamW on the gpu rounds otherwise than CPUAdam
        assert again == rest
        assert resumed.keys() == weights.keys() and all(torch.equal(resumed[k], weights[k]) for k in weights)


def test_a_resume_trains_with_the_runs_own_hyper_parameters_on_every_tier(tmp_path):
    """A run resumed with another weight_decay (betas, eps) trains with it, as its config.yaml says, on the host tier
    as on the SSD tier: the host tier took the checkpoint's from the optimizer's saved param_groups, the SSD tier the
    run's, so the same resume trained otherwise by tier, and the host tier otherwise than its config said."""
    from functools import partial

    from mobiuspipe.optim import CPUAdam

    cfg = _cfg("fp32")
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    torch.manual_seed(7)
    with _pipeline(cfg, None) as pipe:
        _steps(pipe, data, range(2))
        folder = pipe.save_checkpoint(tmp_path / "ckpt")
    heavier = partial(CPUAdam, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5)
    resumed = {}
    for tier in ("host", "ssd"):
        with _pipeline(cfg, _memory(tier, tmp_path / tier), optimizer=heavier) as pipe:
            pipe.load_checkpoint(folder)
            resumed[tier] = (_steps(pipe, data, range(2, 4)), pipe.state_dict())
    (host, host_weights), (ssd, ssd_weights) = resumed["host"], resumed["ssd"]
    assert host == ssd
    assert all(torch.equal(host_weights[k], ssd_weights[k]) for k in ssd_weights)


def _states(pipe) -> dict[tuple[int, str], list[float]]:
    """Every stage's master weights and Adam states (export_state's tensors), as exact values."""
    out = {}
    for j, stage in pipe.stages.items():
        tensors, _ = stage.states.export_state()
        out.update({(j, k): v.double().reshape(-1).tolist() for k, v in tensors.items()})
    return out
