"""Builds the C++ extension mobiuspipe._C (csrc/) with torch.utils.cpp_extension into the package folder."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(__file__).resolve().parent
SOURCES = [
    "csrc/bindings.cpp",
    "csrc/adam/cpu_adam.cpp",
    "csrc/io/async_io.cpp",
    "csrc/io/uring.cpp",
    "csrc/io/crc32c.cpp",
]
CFLAGS = ["-O3", "-fopenmp"]  # per-function target attributes pick the SIMD level: no -march=native
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp.so.1 torch already loaded


def target_path() -> Path:
    """Where the built module goes: mobiuspipe/_C<EXT_SUFFIX>."""
    return PACKAGE / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))


def _clear_stale_baton(build_dir: Path) -> None:
    """cpp_extension's FileBaton 'lock': under our flock nobody else builds, so any left one is stale."""
    baton = build_dir / "lock"
    if baton.exists():
        print(
            f"[build] removing a stale lock {baton} ({time.time() - baton.stat().st_mtime:.0f} s old)", file=sys.stderr
        )
        baton.unlink(missing_ok=True)


def build(build_dir: Path | None = None, verbose: bool = False) -> Path:
    """Compile (or reuse an up-to-date build in build_dir) and install the .so atomically; returns its path."""
    from torch.utils import cpp_extension

    bindir = str(Path(sys.executable).parent)  # a pip-installed ninja lives beside the venv's python
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    build_dir = Path(build_dir or ROOT / "build" / "ext")
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / "ext.flock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # the kernel drops it when a killed build dies
        _clear_stale_baton(build_dir)
        mod = cpp_extension.load(
            name="_C",
            sources=[str(ROOT / s) for s in SOURCES],
            build_directory=str(build_dir),
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            extra_include_paths=[str(ROOT / "csrc")],
            verbose=verbose,
        )
        if not isinstance(mod, ModuleType) or mod.__file__ is None:  # is_python_module=True: a loaded module
            raise RuntimeError(f"cpp_extension.load returned {mod!r}, not a module loaded from a file")
        built = Path(mod.__file__)
        dest = target_path()
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.copy2(built, tmp)
        os.replace(tmp, dest)  # a process that mapped the old file keeps it
    return dest


def main() -> int:
    """Entry point of `python -m mobiuspipe._build`: builds, prints the path, 1 on failure."""
    t0 = time.time()
    try:
        dest = build(verbose="-v" in sys.argv)
    except Exception as exc:  # noqa: BLE001  any compiler/ninja/torch problem: the caller falls back to PyTorch
        print(f"[build] C++ extension failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"[build] {dest.relative_to(ROOT)} built in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
