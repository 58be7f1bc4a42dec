"""Optimizer states on SSD (memory.optimizer: ssd) move tensors, not math: the pipelined run's losses and
weights are bit-identical to the same run with the states in host memory, in fp32 and in bf16."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict, load_config
from mobiuspipe.config_plan import gpt_spec, plan_for_config
from mobiuspipe.dataset import ByteData
from mobiuspipe.errors import ConfigError, PipelineError
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.stage_states import place_states


def _run(precision: str, memory: MemoryConfig | None, steps: int = 3):
    torch.set_num_threads(1)
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": steps, "lr": 0.01, "weight_decay": 0.05, "seed": 5, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )
    t = cfg.train
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = ByteData(cfg.data.text_path, cfg.model.seq_len, t.seed)
    with Pipeline(
        layer_factories(gpt_spec(cfg), t.seed), lm_loss, plan=plan_for_config(cfg), optimizer=opt, memory=memory
    ) as pipe:
        losses = [pipe.train_batch(*data.batch(s, 6)).loss for s in range(steps)]
        return losses, pipe.state_dict(), pipe.placement


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_states_on_ssd_are_bit_identical_to_host(tmp_path, precision):
    host_losses, host_weights, _ = _run(precision, None)
    budget = 0.25  # MiB per rank, 64 KiB per stage: each stage's ~8k parameters stream through 8 groups
    ssd_losses, ssd_weights, _ = _run(
        precision, MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path), host_budget_mb=budget)
    )
    assert ssd_losses == host_losses
    assert ssd_weights.keys() == host_weights.keys()
    for k in host_weights:
        assert torch.equal(ssd_weights[k], host_weights[k]), k
    index = json.loads((tmp_path / "rank0" / "index.json").read_text())
    assert "stage0" in json.dumps(index)  # the states really went to the store


def test_ssd_tier_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="memory.ssd_dir: expected a folder when optimizer is ssd or auto"):
        config_from_dict({"memory": {"optimizer": "ssd"}})
    with pytest.raises(ConfigError, match="memory.optimizer: expected one of host, ssd, auto"):
        config_from_dict({"memory": {"optimizer": "nvme"}})
    _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    with pytest.raises(PipelineError, match="holds the optimizer states of an earlier run"):
        _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    with pytest.raises(PipelineError, match=r"raise memory.host_budget_mb to at least 0.1875"):
        _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "small"), host_budget_mb=0.1), steps=1)
    with pytest.raises(PipelineError, match="stepped by AdamW, but the optimizer factory makes a SGD"):
        Pipeline(
            [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)],
            torch.nn.functional.mse_loss,
            sample=(torch.randn(4, 2), torch.randn(4, 1)),
            num_microbatches=2,
            optimizer=partial(torch.optim.SGD, lr=0.1),
            memory=MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "other")),
        )


@pytest.mark.slow
def test_torchrun_entry_with_auto_states_equals_plain_pytorch(tmp_path, launch, reference):
    """auto under 0.2 MiB: rank 0's stages (0: 13,824 and 2: 7,224 parameters, 253 KB of states) do not
    fit, so its largest streams from SSD; rank 1's (1 and 3, 161 KB) stay in memory."""
    write_config, torchrun = launch
    cfg_path = write_config(
        tmp_path,
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 19},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": 3, "lr": 0.01, "precision": "fp32", "out_dir": str(tmp_path / "out")},
            "plan": {"num_gpus": 2, "num_stages": 4},
            "memory": {"optimizer": "auto", "ssd_dir": str(tmp_path / "ssd"), "host_budget_mb": 0.2},
        },
    )
    proc = torchrun(cfg_path, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == ["rank0"]
    assert "optimizer states (auto): host for stages 1, 2, 3; ssd for stage 0 (under" in proc.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((tmp_path / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    ref_losses, ref_weights = reference(load_config(cfg_path))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)


def test_auto_keeps_states_in_memory_while_they_fit_then_moves_the_largest():
    least = 48 << 10
    params = {0: 1000, 2: 50_000, 4: 20_000}
    assert place_states("auto", params, 12 * 71_000, least).on_ssd == []  # 852,000 bytes: all fit
    # 12 * 71,000 bytes do not fit in 700,000: the largest (stage 2) streams, the others stay
    p = place_states("auto", params, 700_000, least)
    assert p.tiers == {0: "host", 2: "ssd", 4: "host"} and p.slot_bytes == 700_000 - 12 * 21_000
    # too small for stage 4 to stay next to stage 2's slots: both largest stream
    p = place_states("auto", params, 320_000, least)
    assert p.on_ssd == [2, 4] and 12 * 1000 + 2 * p.slot_bytes <= 320_000
    assert place_states("ssd", params, 3 * least, least).slot_bytes == least
    with pytest.raises(ValueError, match="raise memory.host_budget_mb"):
        place_states("auto", params, 100_000, least)  # not even 2 stages on SSD next to stage 0 fit


def test_auto_run_puts_the_largest_stage_on_ssd_and_stays_bit_identical(tmp_path):
    host_losses, host_weights, _ = _run("bf16", None)
    # ~8k parameters per stage (~95 KiB of states each): 0.3 MiB holds two stages and the slots of two others
    memory = MemoryConfig(optimizer="auto", ssd_dir=str(tmp_path), host_budget_mb=0.3)
    losses, weights, placement = _run("bf16", memory)
    assert losses == host_losses
    for k in host_weights:
        assert torch.equal(weights[k], host_weights[k]), k
    tiers = placement.tiers
    assert sorted(tiers.values()).count("ssd") in (1, 2, 3), tiers  # some stages stream, some stay
    index = json.dumps(json.loads((tmp_path / "rank0" / "index.json").read_text()))
    for j, tier in tiers.items():
        assert (f"stage{j}" in index) == (tier == "ssd"), (j, tier)
