"""An extension built against another torch is not used: its ABI may load and then fail inside a call (seen on
torch 2.11 with a build for 2.13: "tensor does not have a device" in the host Adam), so the import refuses it and
says how to rebuild."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mobiuspipe import _ext

OURS = torch.__version__.split("+")[0]
"""The torch the extension was built against here (scripts/setup.sh builds it for the venv's torch)."""
OTHER = "2.11.0" if OURS != "2.11.0" else "2.12.0"

pytestmark = pytest.mark.skipif(not _ext.HAVE_C, reason=f"C++ extension not built ({_ext.WHY_NOT})")

_PROBE = """
import warnings, torch
torch.__version__ = {version!r}  # the torch this process runs, as the extension's check reads it
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from mobiuspipe import _ext
print(_ext.HAVE_C)
print(" | ".join(str(w.message).replace(chr(10), " ") for w in seen))
print(len(seen))
"""


def _load_under(version: str) -> tuple[bool, str, int]:
    """Whether the extension is used under torch `version`, what the import warned, and how many warnings."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(version=version)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    have, said, warned = out.stdout.splitlines()[-3:]
    return have == "True", said, int(warned)


def test_an_extension_built_for_another_torch_is_refused_with_the_fix():
    have, said, warned = _load_under(f"{OTHER}+cu130")
    assert not have and warned == 1
    for part in (f"built against torch {OURS}", f"this is torch {OTHER}", "python -m mobiuspipe._build"):
        assert part in said, said


def test_the_extension_loads_under_its_own_torch_whatever_its_build_tag():
    have, said, warned = _load_under(f"{OURS}+cu130")  # a local tag (+cpu, +cu130) is not another ABI
    assert have and warned == 0, said
