"""A Pipeline's kernels run on its rank's compute stream, whatever stream its caller is in: every copy's wait and
every compute mark names that stream, so a user's `torch.cuda.stream` context around train_batch would otherwise
break every ordering. On the CPU: each device operation of the public methods runs inside Device.computing; on a
GPU: a run inside a side stream's context equals one outside it, bit for bit."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.device import Device
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def _cfg():
    return config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17, "vocab_size": 256},
            "data": {"batch_size": 4, "num_microbatches": 2},
            "train": {"steps": 2, "lr": 0.01, "seed": 5, "precision": "fp32"},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
            "memory": {"activations": "keep", "activation_tier": "host"},
        }
    )


def _pipeline(cfg) -> Pipeline:
    t = cfg.train
    optimizer = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    memory = cfg.memory
    return Pipeline(
        layer_factories(model_spec(cfg), t.seed), lm_loss, plan=plan_for_config(cfg), optimizer=optimizer, memory=memory
    )


def _use(pipe: Pipeline, cfg, tmp_path) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    losses = [pipe.train_batch(*data.batch(s, cfg.data.batch_size)).loss for s in range(cfg.train.steps)]
    folder = pipe.save_checkpoint(tmp_path / "ckpt")
    pipe.load_checkpoint(folder)
    return losses, pipe.eval_batch(*data.batch(9, cfg.data.batch_size)), pipe.state_dict()


def test_every_device_operation_of_the_public_methods_runs_in_the_compute_stream(monkeypatch, tmp_path):
    inside, seen = threading.local(), []
    computing = Device.computing

    @contextmanager
    def counted(self):
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            with computing(self):
                yield
        finally:
            inside.depth -= 1

    def recorded(name, real):
        def op(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                seen.append((name, getattr(inside, "depth", 0) > 0))
            return real(self, *args, **kwargs)

        return op

    monkeypatch.setattr(Device, "computing", counted)
    cfg = _cfg()
    with _pipeline(cfg) as pipe:
        for name in ("to_device", "empty", "_computed", "copy_out", "copy_back", "to_host"):
            monkeypatch.setattr(Device, name, recorded(name, getattr(Device, name)))
        _use(pipe, cfg, tmp_path)
        names = {n for n, _ in seen}
        assert {"to_device", "empty", "_computed", "copy_out", "copy_back"} <= names, names
        assert [n for n, within in seen if not within] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_run_inside_a_callers_side_stream_equals_one_outside(tmp_path):
    cfg = _cfg()
    with _pipeline(cfg) as pipe:
        want = _use(pipe, cfg, tmp_path / "a")
    side = torch.cuda.Stream()
    with _pipeline(cfg) as pipe, torch.cuda.stream(side):
        got = _use(pipe, cfg, tmp_path / "b")
    assert got[0] == want[0] and got[1] == want[1]
    for k in want[2]:
        assert torch.equal(got[2][k], want[2][k]), k
