"""A full disk (or an I/O error) under out_dir while the run writes its records (metrics.jsonl, TensorBoard's
events) or its final weights is a named mistake, the file, the errno and the fix, which `mobiuspipe train`
prints as its last line (exit 2): not a traceback, and not a peer's "a rank has probably died" after it. The
failed write leaves no temporary file. /dev/full fails every write with ENOSPC, as a full disk does."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from foundation.errors import UserError
from mobiuspipe.run.metrics import Reporter
from mobiuspipe.run.train import _save_weights

from .test_metrics import _m

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


@pytest.mark.parametrize("tensorboard", [False, True])
def test_a_full_disk_under_the_records_is_named(tmp_path, tensorboard):
    (tmp_path / "metrics.jsonl").symlink_to(FULL)
    with pytest.raises(UserError) as e, Reporter(2, 1, str(tmp_path), None, tensorboard=tensorboard) as report:
        report(_m(0))
    message = str(e.value)
    assert f"rank 0 could not write {tmp_path / 'metrics.jsonl'}: No space left on device (errno 28)" in message
    assert f"free space in {tmp_path}, then run again with --resume auto" in message


def test_a_full_disk_under_the_final_weights_is_named_and_leaves_no_tmp_file(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / ".stage1.pt.tmp").symlink_to(FULL)  # the disk fills as stage 1's file is written
    pipe = SimpleNamespace(rank=1, stage_state_dicts=lambda frozen: {1: {"w": torch.ones(1 << 16)}})
    with pytest.raises(UserError) as e:
        _save_weights(pipe, folder)  # pyright: ignore[reportArgumentType] -- a stand-in with what it reads
    message = str(e.value)
    assert f"rank 1 could not write {folder / '.stage1.pt.tmp'}: No space left on device (errno 28)" in message
    assert not os.path.lexists(folder / ".stage1.pt.tmp") and not (folder / "stage1.pt").exists()
