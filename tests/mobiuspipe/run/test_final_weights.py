"""The run's final weights (out_dir/weights/stage{j}.pt) are durable once named: each file is flushed to the disk
before it takes its name, and the folder's entries after."""

from __future__ import annotations

import os
from typing import cast

import torch

from mobiuspipe.pipeline import Pipeline
from mobiuspipe.run import train


class _Pipe:
    def stage_state_dicts(self, frozen: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        return {0: {"0.w": torch.arange(5.0)}, 3: {"4.w": torch.ones(3)}}


def test_each_stage_file_is_fsynced_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def synced(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def renamed(src, dst, **kw):
        events.append(("rename", os.path.basename(src), os.path.basename(dst)))
        replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    train._save_weights(cast(Pipeline, _Pipe()), tmp_path / "weights")  # what it reads of a Pipeline
    for j in (0, 3):
        rename = events.index(("rename", f".stage{j}.pt.tmp", f"stage{j}.pt"))
        assert ("fsync", f".stage{j}.pt.tmp") in events[:rename]
    assert events[-1] == ("fsync", "weights")
    assert torch.equal(torch.load(tmp_path / "weights" / "stage3.pt")["4.w"], torch.ones(3))
