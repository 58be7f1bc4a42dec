"""`mobiuspipe env`: versions, usable solvers, CUDA and NVML state, CPU threads and shared memory of this machine."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

from foundation.shm import SHM_ADVISED_BYTES, ShmSpace, shm_space
from foundation.units import fmt_bytes

__all__ = ["register", "run", "collect_env", "render_env"]

NOT_INSTALLED = "not installed"
PACKAGES = ("mobiuspipe", "torch", "numpy", "highspy", "gurobipy", "nvidia-ml-py")
"""Distributions whose versions `env` reports (nvidia-ml-py provides the `pynvml` module)."""
GUROBI_NOTE = "installed (size-limited license unless a full one is present)"


def register(sub) -> None:
    """Add the `env` subcommand to the CLI's subparsers."""
    p = sub.add_parser("env", help="versions, solvers, CUDA, NVML, CPU threads and shared memory of this machine")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out) -> int:
    """Print the report, or the JSON document, on `out`."""
    d = collect_env()
    out.write(json.dumps(d, indent=2) + "\n" if args.json else render_env(d))
    return 0


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        if dist == "nvidia-ml-py":  # the older, separately packaged binding provides the same module
            return _version("pynvml") if _importable("pynvml") else NOT_INSTALLED
        return NOT_INSTALLED


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _solvers() -> dict[str, str]:
    """dp is built in; highs is usable when highspy imports; gurobi's licence is not probed (no optimize())."""
    return {
        "dp": "built in",
        "highs": "usable" if _importable("highspy") else NOT_INSTALLED,
        "gurobi": GUROBI_NOTE if _importable("gurobipy") else NOT_INSTALLED,
    }


def _cuda() -> dict:
    try:
        import torch
    except ImportError:
        return {
            "available": False,
            "device_count": 0,
            "devices": [],
            "cuda_version": None,
            "torch_threads": None,
            "note": "torch not installed",
        }
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    return {
        "available": available,
        "device_count": count,
        "devices": [torch.cuda.get_device_name(i) for i in range(count)],
        "cuda_version": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
    }


def _nvml() -> dict:
    """Whether NVML initializes; on failure the error class name (e.g. NVMLError_LibraryNotFound) and text."""
    try:
        import pynvml
    except ImportError:
        return {"ok": False, "error": "ImportError", "message": "nvidia-ml-py is not installed"}
    try:
        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML raises one class per failure cause; report which, never crash `env`
        return {"ok": False, "error": type(e).__name__, "message": str(e)}
    return {
        "ok": True,
        "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
        "device_count": count,
    }


def collect_env() -> dict:
    """The `env --json` document."""
    cuda = _cuda()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": {name: _version(name) for name in PACKAGES},
        "solvers": _solvers(),
        "cuda": {k: v for k, v in cuda.items() if k != "torch_threads"},
        "nvml": _nvml(),
        "cpu_count": os.cpu_count(),
        "torch_threads": cuda["torch_threads"],
        "shm": _shm(),
    }


def _shm() -> dict | None:
    """/dev/shm's size (None where there is none): NCCL between gpus without peer-to-peer keeps its messages there."""
    space = shm_space()
    if space is None:
        return None
    return {"path": space.path, "total_bytes": space.total, "free_bytes": space.free, "small": space.small}


def _shm_line(s: dict | None) -> str:
    if s is None:
        return "none (not Linux)"
    line = ShmSpace(s["path"], s["total_bytes"], s["free_bytes"]).describe()
    if s["small"]:
        line += (
            f"; below {fmt_bytes(SHM_ADVISED_BYTES)}: NCCL between gpus without peer-to-peer may fail there "
            f"(a container: --shm-size=1g or --ipc=host)"
        )
    return line


def _cuda_line(c: dict) -> str:
    if c["available"]:
        return f"available, {c['device_count']} gpu(s): " + ", ".join(c["devices"])
    why = c.get("note") or ("torch built without CUDA" if c["cuda_version"] is None else "no CUDA device visible")
    return f"not available ({why})"


def _nvml_line(n: dict) -> str:
    if n["ok"]:
        return f"ok, driver {n['driver_version']}, {n['device_count']} device(s)"
    return f"failed: {n['error']} ({n['message']})"


def render_env(d: dict) -> str:
    """The readable `env` report, one fact per line."""
    rows = [("python", f"{d['python']['version']} ({d['python']['executable']})")]
    rows += list(d["packages"].items())
    rows.append(("solvers", "; ".join(f"{k}: {v}" for k, v in d["solvers"].items())))
    rows += [
        ("cuda", _cuda_line(d["cuda"])),
        ("nvml", _nvml_line(d["nvml"])),
        ("cpus", f"{d['cpu_count']} (torch threads {d['torch_threads']})"),
        ("shm", _shm_line(d["shm"])),
    ]
    width = max(len(k) for k, _ in rows) + 2
    return "".join(f"{k:<{width}}{v}\n" for k, v in rows)
