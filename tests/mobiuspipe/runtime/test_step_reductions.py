"""A step's figures that every rank needs cross the ranks in two reductions: the sums (the loss, the gradients' squared
norm, the count of ranks whose gradients overflowed) in one, the maxima (the metrics) in the other. Each reduction
is a collective the ranks wait for (on NCCL a read of the gpu after it); the loss, the norm and the overflow flag
went in one each."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.data.dataset import open_data
from mobiuspipe.optim.loss_scale import LossScaler
from tests.mobiuspipe.runtime.update_runs import BATCH, update_config, update_pipeline


@pytest.mark.parametrize(
    "fp16,clip",
    [(False, None), (True, None), (False, 1.0), (True, 1.0)],
)
def test_a_step_reduces_twice(monkeypatch, fp16, clip):
    torch.set_num_threads(1)
    cfg = update_config("fp16" if fp16 else "bf16")
    t = cfg.train
    pipe = update_pipeline(cfg, max_grad_norm=clip, loss_scaler=LossScaler(scale=2.0**8) if fp16 else None)
    ops = []
    reduce = pipe._reduce

    def counted(values, op, what):
        ops.append(op)
        return reduce(values, op, what)

    monkeypatch.setattr(pipe, "_reduce", counted)
    with pipe:
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        result = pipe.train_batch(*data.batch(0, BATCH))
    assert sorted(map(str, ops)) == sorted(map(str, [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX]))
    assert (result.grad_norm is not None) == (clip is not None) and not result.skipped
