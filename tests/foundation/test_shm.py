"""The host's shared memory: its size read from the folder, and when it is small."""

from __future__ import annotations

import os

from foundation.shm import SHM_ADVISED_BYTES, ShmSpace, shm_fix, shm_space
from foundation.units import MiB


def test_the_size_is_the_folders_own(tmp_path):
    space = shm_space(str(tmp_path))
    assert space is not None
    st = os.statvfs(tmp_path)
    assert space == ShmSpace(str(tmp_path), st.f_blocks * st.f_frsize, space.free)
    assert 0 < space.free <= space.total


def test_a_folder_that_is_not_there_has_no_size(tmp_path):
    assert shm_space(str(tmp_path / "absent")) is None


def test_small_is_below_the_advised_size():
    assert ShmSpace("/dev/shm", 64 * MiB, 60 * MiB).small
    assert not ShmSpace("/dev/shm", SHM_ADVISED_BYTES, 0).small


def test_the_fix_names_the_size_and_the_ways_to_grow_it():
    text = shm_fix(ShmSpace("/dev/shm", 64 * MiB, 60 * MiB))
    assert text.startswith("/dev/shm: 64.00 MiB, 60.00 MiB free; ")
    assert "--shm-size=1g" in text and "--ipc=host" in text and "remount,size=1G /dev/shm" in text
