"""The passes of an accumulated step run back to back: the host reads what the device computed (the loss, the
spans' marks) once, at the step's end, whatever the number of passes. On CUDA a read at each pass's end would drain
the compute stream there: the next pass's first loads would be issued only then, on an idle gpu, and the pipeline
would fill again from empty each pass. Counted on the stand-in as the host reads of tensors during a steady step
and the clock's anchors (a synchronization each on CUDA)."""

from __future__ import annotations

import threading

import torch

from mobiuspipe.data.dataset import open_data
from mobiuspipe.runtime.clock import ActionClock
from tests.mobiuspipe.runtime.update_runs import BATCH, update_config, update_pipeline

READS = ("tolist", "item", "__float__", "__bool__", "__int__")


def _reads_in_a_steady_step(monkeypatch, passes: int) -> dict[str, int]:
    """The compute thread's host reads of tensors and clock anchors during the second step of a run of `passes`
    passes a step."""
    torch.set_num_threads(1)
    cfg = update_config("bf16")
    t = cfg.train
    pipe = update_pipeline(cfg, accumulation_steps=passes)
    counts = {"reads": 0, "anchors": 0}
    compute = threading.get_ident()

    def counted(key, fn):
        def spy(*args, **kwargs):
            counts[key] += threading.get_ident() == compute  # not the host updates' reads of their own tensors
            return fn(*args, **kwargs)

        return spy

    with pipe:
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        pipe.train_batch(*data.batch(0, passes * BATCH))  # the first step learns the messages' shapes
        with monkeypatch.context() as m:
            for name in READS:
                m.setattr(torch.Tensor, name, counted("reads", getattr(torch.Tensor, name)))
            m.setattr(ActionClock, "start_step", counted("anchors", ActionClock.start_step))
            pipe.train_batch(*data.batch(1, passes * BATCH))
    return counts


def test_an_accumulated_step_reads_the_device_once_however_many_passes(monkeypatch):
    one, three = _reads_in_a_steady_step(monkeypatch, 1), _reads_in_a_steady_step(monkeypatch, 3)
    assert three == one, f"3 passes: {three}, 1 pass: {one}"
    assert one["anchors"] == 1
