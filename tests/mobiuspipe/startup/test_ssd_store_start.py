"""A run's SSD store starts empty: what an earlier run (or attempt) left under memory.ssd_dir is discarded with a
warning, whether it was optimizer states (which keep metadata) or a frozen base's records (which keep none)."""

from __future__ import annotations

import os

import pytest
import torch

from mobiuspipe.config import MemoryConfig
from mobiuspipe.memory.aio import aligned_empty
from mobiuspipe.memory.weight_stream import SsdRecords
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.startup.tiers import _store

RANK0 = RankInfo(rank=0, world_size=1, local_rank=0, under_torchrun=False)


def test_a_frozen_bases_records_from_an_earlier_run_are_discarded(tmp_path):
    """memory.frozen ssd with the optimizer in memory: the records carry no metadata, and a later run with another
    plan (fewer stages) kept every earlier record and its file, a large base's hundreds of GB each time."""
    mem = MemoryConfig(frozen="ssd", ssd_dir=str(tmp_path))
    store = _store(RANK0, mem)
    for j in range(5):
        SsdRecords(store, f"stage{j}/frozen", torch.zeros(1 << 20, dtype=torch.uint8), 1 << 18, aligned_empty)
    store.close()
    with pytest.warns(UserWarning, match="discarding the states an earlier run left in"):
        store = _store(RANK0, mem)
    try:
        assert store.keys() == []
        assert not [f for f in os.listdir(store.folder) if f.endswith(".bin")]
    finally:
        store.close()
