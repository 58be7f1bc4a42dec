"""The passes of an accumulated step run back to back: the host reads what the device computed (the loss, the
spans' marks) once, at the step's end, whatever the number of passes. On CUDA a read at each pass's end would drain
the compute stream there: the next pass's first loads would be issued only then, on an idle gpu, and the pipeline
would fill again from empty each pass. Counted on the stand-in as the host reads of tensors during a steady step
and the clock's anchors (a synchronization each on CUDA)."""

from __future__ import annotations

import threading

import torch

from mobiuspipe.config import MemoryConfig
from mobiuspipe.data.dataset import open_data
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.runtime.clock import ActionClock
from tests.mobiuspipe.runtime.update_runs import BATCH, update_config, update_pipeline

READS = ("tolist", "item", "__float__", "__bool__", "__int__")


def _reads_in_a_steady_step(
    monkeypatch, passes: int, precision: str = "bf16", memory: MemoryConfig | None = None, **kwargs
) -> dict[str, int]:
    """The compute thread's host reads of tensors and clock anchors during the second step of a run of `passes`
    passes a step (in precision, with memory; kwargs go to the Pipeline)."""
    torch.set_num_threads(1)
    cfg = update_config(precision, memory)
    t = cfg.train
    pipe = update_pipeline(cfg, accumulation_steps=passes, **kwargs)
    counts = {"reads": 0, "anchors": 0}
    compute = threading.get_ident()
    inside = [0]  # a read the stand-in's tensors make of their own inside a read is that read

    def counted(key, fn):
        def spy(*args, **kwargs):
            if threading.get_ident() != compute:  # the host updates' reads of their own tensors
                return fn(*args, **kwargs)
            counts[key] += not inside[0]
            inside[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] -= 1

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


def test_the_gradient_checks_of_gpu_resident_states_are_one_read(monkeypatch):
    """memory.optimizer: device keeps each stage's gradients, their squared norm and their finiteness on the gpu:
    clipping and fp16's overflow check read them all at once, not each stage's on its own (4 stages here). Against a
    bf16 step with neither: fp16's check adds that read; clipping adds it and the clip factor's rounding to float32
    (a host tensor's read)."""
    on_gpu = MemoryConfig(optimizer="device")
    neither = _reads_in_a_steady_step(monkeypatch, 1, "bf16", on_gpu)
    clipped = _reads_in_a_steady_step(monkeypatch, 1, "bf16", on_gpu, max_grad_norm=1.0)
    scaler = LossScaler(scale=2.0**8)
    fp16 = _reads_in_a_steady_step(monkeypatch, 1, "fp16", on_gpu, loss_scaler=scaler)
    both = _reads_in_a_steady_step(monkeypatch, 1, "fp16", on_gpu, loss_scaler=scaler, max_grad_norm=1.0)
    added = {"fp16": fp16["reads"], "clipping": clipped["reads"], "both": both["reads"]}
    added = {k: v - neither["reads"] for k, v in added.items()}
    assert added == {"fp16": 1, "clipping": 2, "both": 2}, added
