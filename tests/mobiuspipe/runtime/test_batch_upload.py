"""A step's and an evaluation's uploads of the microbatches' inputs and targets never make the host wait for the gpu,
whatever their size. On CUDA a pageable tensor over PIN_COPY_LIMIT is copied with a host wait (the route meant for a
stage's states at start-up or from a checkpoint): a microbatch's targets, uploaded after its last forward is queued,
would drain the compute stream once a microbatch, and a later pass's inputs would drain it between passes. Seen on
the stand-in as the route Device.to_device takes (PIN_COPY_LIMIT set to 0: every batch tensor counts as large)."""

from __future__ import annotations

import torch

from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory import device as device_module
from tests.mobiuspipe.runtime.update_runs import BATCH, update_config, update_pipeline


def test_a_steps_batch_uploads_never_wait_whatever_their_size(monkeypatch):
    torch.set_num_threads(1)
    cfg = update_config("bf16")
    t = cfg.train
    routes: list[str] = []
    route = device_module.upload_route
    with update_pipeline(cfg, accumulation_steps=2) as pipe:
        data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
        monkeypatch.setattr(device_module, "PIN_COPY_LIMIT", 0)
        monkeypatch.setattr(device_module, "upload_route", lambda *a, **k: routes.append(r := route(*a, **k)) or r)
        pipe.train_batch(*data.batch(0, 2 * BATCH))
        pipe.eval_batch(*data.batch(1, BATCH))
    assert routes and set(routes) == {"pin"}, routes


def test_stage_0s_device_inputs_are_let_go_once_used(monkeypatch):
    """Stage 0's inputs go to the device at the pass's start; the walk and the ledger let each go at its forward (or
    at its backward, where the stage keeps it to recompute from), but the pass's state kept every one referenced
    until the next pass began, so a gpu's allocator held them all (float inputs of a custom first stage: large; a
    swap tier freed nothing)."""
    import weakref

    from mobiuspipe.runtime import compute as compute_module

    refs: list[weakref.ref] = []
    made = compute_module.Compute.device_inputs

    def recorded(self, xs):
        out = made(self, xs)
        refs.extend(weakref.ref(x) for x in out)
        return out

    monkeypatch.setattr(compute_module.Compute, "device_inputs", recorded)
    torch.set_num_threads(1)
    cfg = update_config("fp32")
    with update_pipeline(cfg) as pipe:
        data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        pipe.train_batch(*data.batch(0, BATCH))
        assert len(refs) == 2 and all(r() is None for r in refs)
