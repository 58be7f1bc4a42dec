"""The whole suite runs the CPU stand-ins as strict as CUDA and NCCL (mobiuspipe.standin); a test that needs the
lax ones sets MOBIUSPIPE_STRICT=0 itself. Set before any test starts a rank, which inherits it.

On a machine with a GPU the suite still runs on the stand-ins (CUDA hidden from it and from the ranks it starts),
so it proves the same things there as in CI; the gpu-marked tests (`pytest -m gpu`, which scripts/gpu_check.sh
runs) see the GPU."""

import importlib.util
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("MOBIUSPIPE_STRICT", "1")


def pytest_configure(config):
    """Hide CUDA unless the gpu-marked tests are selected (before any test asks torch for a device), else make its
    kernels deterministic; give the processes the tests start a temporary folder of the session's own."""
    if "gpu" not in (config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:  # the gpu tests compare runs bit for bit: kernels that give the same bits each run (cuBLAS's too)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without such a kernel warns, not fails
    config.children_tmp = _children_tmpdir()


def pytest_unconfigure(config):
    if getattr(config, "children_tmp", None):
        shutil.rmtree(config.children_tmp, ignore_errors=True)


def _children_tmpdir() -> str:
    """A folder, removed after the session, that the ranks, torchruns and launchers the tests start take as TMPDIR
    (torchrun keeps a torchelastic_* folder a launch; a launcher a test kills keeps its start-up folder). The tests'
    own process keeps the temporary folder it had."""
    tempfile.tempdir = tempfile.gettempdir()
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="mobiuspipe-tests-")
    return os.environ["TMPDIR"]


def pytest_collection_modifyitems(config, items):
    """Skip the mip-marked tests where no MIP solver is installed (a GPU box whose python has none, say)."""
    if any(importlib.util.find_spec(name) is not None for name in ("highspy", "gurobipy")):
        return
    skip = pytest.mark.skip(reason="no MIP solver installed (pip install highspy; setup.sh does)")
    for item in items:
        if "mip" in item.keywords:
            item.add_marker(skip)
