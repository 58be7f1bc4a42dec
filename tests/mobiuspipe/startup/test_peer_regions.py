"""A peer region a rank cannot open (CUDA IPC refused) is an error that names the cause and the fixes."""

from __future__ import annotations

import pytest

from mobiuspipe.errors import PipelineError
from mobiuspipe.startup import peer_regions

REFUSED = "pidfd_getfd: Operation not permitted\nmore"


def _refuse(handle):
    raise RuntimeError(REFUSED)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:128", None])
def test_a_refused_region_names_the_cause_and_the_fixes(monkeypatch, conf):
    monkeypatch.setattr(peer_regions, "open_shared", _refuse)
    if conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with pytest.raises(PipelineError) as e:
        peer_regions._open(("a cuda ipc handle",), 1024)
    text = str(e.value)
    assert text.startswith("activation_tier peer: this rank could not open")
    assert "(pidfd_getfd: Operation not permitted)" in text and "more" not in text
    assert text.endswith("or park activations in host memory (memory.activation_tier: host)")
    assert ("--cap-add SYS_PTRACE" in text and "#165685" in text) == (conf == "expandable_segments:True")


def test_the_cpu_stand_in_opens_its_shared_file(tmp_path):
    path = tmp_path / "region"
    given = peer_regions.shm_region(str(path), 64)
    given[:] = 7
    assert int(peer_regions._open(str(path), 64).sum()) == 7 * 64
