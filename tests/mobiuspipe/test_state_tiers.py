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
        return losses, pipe.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_states_on_ssd_are_bit_identical_to_host(tmp_path, precision):
    host_losses, host_weights = _run(precision, None)
    budget = 0.25  # MiB per rank, 64 KiB per stage: each stage's ~8k parameters stream through 8 groups
    ssd_losses, ssd_weights = _run(
        precision, MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path), host_budget_mb=budget)
    )
    assert ssd_losses == host_losses
    assert ssd_weights.keys() == host_weights.keys()
    for k in host_weights:
        assert torch.equal(ssd_weights[k], host_weights[k]), k
    index = json.loads((tmp_path / "rank0" / "index.json").read_text())
    assert "stage0" in json.dumps(index)  # the states really went to the store


def test_ssd_tier_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="memory.ssd_dir: expected a folder when optimizer is ssd"):
        config_from_dict({"memory": {"optimizer": "ssd"}})
    with pytest.raises(ConfigError, match="memory.optimizer: expected one of host, ssd"):
        config_from_dict({"memory": {"optimizer": "nvme"}})
    _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    with pytest.raises(PipelineError, match="holds the optimizer states of an earlier run"):
        _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    with pytest.raises(PipelineError, match="raise host_budget_mb to at least 0.1875"):
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
def test_torchrun_entry_with_states_on_ssd_equals_plain_pytorch(tmp_path, launch, reference):
    write_config, torchrun = launch
    cfg_path = write_config(
        tmp_path,
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 19},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": 3, "lr": 0.01, "precision": "fp32", "out_dir": str(tmp_path / "out")},
            "plan": {"num_gpus": 2, "num_stages": 4},
            "memory": {"optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd"), "host_budget_mb": 0.5},
        },
    )
    proc = torchrun(cfg_path, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == ["rank0", "rank1"]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((tmp_path / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    ref_losses, ref_weights = reference(load_config(cfg_path))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)
