"""Checkpoints of states in the SSD store without a second copy: the store's record files are hard-linked into
the checkpoint and never written in place while linked; resume links them back. Another filesystem copies
them through memory instead, and another group size is read into the new layout; all resume bit-identically.
A damaged record is a named error."""

from __future__ import annotations

import errno
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mobiuspipe import Pipeline, checkpoint
from mobiuspipe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

CFG = config_from_dict(
    {
        "model": {"num_blocks": 3, "d_model": 40, "num_heads": 5, "seq_len": 13},
        "data": {"batch_size": 6, "num_microbatches": 3},
        "train": {"lr": 0.01, "seed": 3, "precision": "bf16"},
        "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
    }
)
DATA = open_data(CFG.data, CFG.model.seq_len, 3, CFG.model.vocab_size)


def _pipe(folder, budget_mb: float = 0.25, weights: str = "ssd") -> Pipeline:
    memory = MemoryConfig(optimizer="ssd", weights=weights, ssd_dir=str(folder), host_budget_mb=budget_mb)
    opt = partial(CPUAdam, lr=0.01, weight_decay=0.05)
    return Pipeline(
        layer_factories(model_spec(CFG), 3), lm_loss, plan=plan_for_config(CFG), optimizer=opt, memory=memory
    )


def _train(pipe, steps) -> list[float]:
    return [pipe.train_batch(*DATA.batch(s, 6)).loss for s in steps]


def _linked(folder) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*.bin"))


def _tensors(folder) -> list[str]:
    with safe_open(str(folder / "rank0.safetensors"), "pt") as f:
        return sorted(f.keys())


def _reference(tmp_path, steps: int):
    with _pipe(tmp_path / "ref") as pipe:
        return _train(pipe, range(steps)), pipe.state_dict()


def _same(got, want) -> None:
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_store_keeps_a_linked_file_as_it_was(tmp_path):
    a, b = torch.randn(1000), torch.randn(1000)
    with SSDStore(tmp_path / "s") as store:
        store.put("k", a)
        first = store.info("k").file
        store.link_to("k", str(tmp_path / "snap.bin"))
        store.put("k", b)  # not in place: the link keeps a's bytes
        assert store.info("k").file != first and torch.equal(store.get("k"), b)
        store.flush()  # the index names the new file: the old name leaves the store
        assert not (tmp_path / "s" / first).exists()
        store.put("k", a)  # an unshared file is written in place again
        assert os.stat(tmp_path / "snap.bin").st_nlink == 1
    kept = bytearray((tmp_path / "snap.bin").read_bytes()[: a.numel() * 4])  # O_DIRECT pads the file to 4 KiB
    assert torch.equal(torch.frombuffer(kept, dtype=torch.float32), a)


def test_ssd_states_are_linked_not_copied_and_resume_bit_identically(tmp_path):
    want_losses, want = _reference(tmp_path, 5)
    root = tmp_path / "ckpt"
    with _pipe(tmp_path / "a") as pipe:
        _train(pipe, range(2))
        folder = save_checkpoint(pipe, root, keep=2)
        links = _linked(folder)
        assert links and all(os.stat(p).st_nlink == 2 for p in links)  # the store's own files
        before = {p: open(p, "rb").read() for p in links}
        _train(pipe, range(2, 4))  # the store writes on, into new files
        assert {p: open(p, "rb").read() for p in links} == before
    assert _tensors(folder) == ["rng/torch"]  # the random state only: no states copied
    with _pipe(tmp_path / "b") as pipe:
        assert load_checkpoint(pipe, folder) == 2
        assert all(os.stat(p).st_nlink == 2 for p in links)  # linked into the new store: adopted, not copied
        assert _train(pipe, range(2, 5)) == want_losses[2:]
        _same(pipe.state_dict(), want)
    assert {p: open(p, "rb").read() for p in links} == before  # the resumed run wrote new files too


def test_another_filesystem_copies_and_another_budget_relayouts(tmp_path, monkeypatch):
    want_losses, want = _reference(tmp_path, 4)
    with _pipe(tmp_path / "a") as pipe:
        _train(pipe, range(2))
        linked = save_checkpoint(pipe, tmp_path / "linked", keep=1)

        def cross_device(src, dst, *a, **kw):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

        with monkeypatch.context() as m:
            m.setattr(os, "link", cross_device)
            with pytest.warns(RuntimeWarning, match="each SSD record is copied into it, file by file"):
                copied = save_checkpoint(pipe, tmp_path / "copied", keep=1)
    assert _linked(copied) and all(os.stat(p).st_nlink == 1 for p in _linked(copied))  # copies, not links
    # the copies are adopted as links are (their files get a second name, the new store's); 0.5 MiB makes groups
    # twice as big as those linked: read and written anew (one name each)
    for folder, budget, adopted in ((copied, 0.25, True), (linked, 0.5, False)):
        with _pipe(tmp_path / f"r{budget}", budget) as pipe:
            assert load_checkpoint(pipe, folder) == 2
            store_files = _linked(tmp_path / f"r{budget}")
            assert store_files and any(os.stat(p).st_nlink == 2 for p in store_files) == adopted
            assert _train(pipe, range(2, 4)) == want_losses[2:]
            _same(pipe.state_dict(), want)


def test_another_filesystem_copies_the_records_file_by_file(tmp_path, monkeypatch):
    """A checkpoint folder on another filesystem than memory.ssd_dir (no hard links): the states were read into
    host memory whole (12 bytes a parameter, for states on SSD because memory cannot hold them) and written to the
    rank's file. Each record is now copied as a file, as a link would have been; the resumed run is the same."""
    from mobiuspipe.optim.ooc_adam import OutOfCoreAdam

    want_losses, want = _reference(tmp_path, 4)

    def cross_device(src, dst, *a, **kw):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def whole(self, *a, **kw):
        raise AssertionError("the states read into memory whole")

    with _pipe(tmp_path / "a") as pipe:
        _train(pipe, range(2))
        with monkeypatch.context() as m:
            m.setattr(os, "link", cross_device)
            m.setattr(OutOfCoreAdam, "read_state", whole)
            copied = save_checkpoint(pipe, tmp_path / "copied", keep=1)
    files = _linked(copied)
    assert files and all(os.stat(p).st_nlink == 1 for p in files) and _tensors(copied) == ["rng/torch"]
    with _pipe(tmp_path / "b") as pipe:
        assert load_checkpoint(pipe, copied) == 2
        assert _train(pipe, range(2, 4)) == want_losses[2:]
        _same(pipe.state_dict(), want)


def test_a_damaged_record_is_named(tmp_path):
    with _pipe(tmp_path / "a", budget_mb=1.0, weights="host") as pipe:
        _train(pipe, range(1))
        folder = save_checkpoint(pipe, tmp_path / "ckpt", keep=1)
    victim = _linked(folder)[0]
    with open(victim, "r+b") as f:  # one flipped byte
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    with _pipe(tmp_path / "b", budget_mb=1.0, weights="host") as pipe, pytest.raises(CheckpointError) as e:
        load_checkpoint(pipe, folder)
    assert f"{victim} fails its crc32c checksum" in str(e.value) and f"remove {folder}" in str(e.value)


def test_a_crashed_stores_files_never_become_new_ones(tmp_path):
    a = torch.randn(1000)
    crashed = SSDStore(tmp_path / "s")
    crashed.put("k", a)
    crashed.link_to("k", str(tmp_path / "snap.bin"))
    os.close(crashed._lock_fd)  # killed: no index was ever written, its file is an orphan
    with SSDStore(tmp_path / "s") as store:  # the next attempt's store: same folder, file names from 0 again
        assert os.stat(tmp_path / "snap.bin").st_nlink == 1  # the orphan's name is gone, the link stays
        store.put("k", torch.zeros(1000))
    kept = bytearray((tmp_path / "snap.bin").read_bytes()[:4000])
    assert torch.equal(torch.frombuffer(kept, dtype=torch.float32), a)


def test_every_folder_between_a_linked_file_and_the_checkpoint_is_fsynced(tmp_path, monkeypatch):
    """A crash after `complete` must not lose a folder entry: the linked records' folders (rank0/stage{j}), the
    rank's folder holding them (rank0) and the checkpoint's own are each flushed before the checkpoint is named."""
    synced = []
    real = checkpoint.fsync_path
    monkeypatch.setattr(checkpoint, "fsync_path", lambda p: synced.append(Path(p).name) or real(p))
    with _pipe(tmp_path / "a") as pipe:
        _train(pipe, range(1))
        folder = save_checkpoint(pipe, tmp_path / "ckpt", keep=2)
    stages = sorted(p.name for p in (folder / "rank0").iterdir())
    assert stages and set(stages) <= set(synced)
    assert "rank0" in synced and ".partial-step-1" in synced
