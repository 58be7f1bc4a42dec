"""Loads the optional C++ extension mobiuspipe._C; HAVE_C says whether it is there (else PyTorch fallbacks)."""

from __future__ import annotations

import re
import warnings
from typing import NoReturn


class _Missing:
    """Stands in for the extension when it did not load: any use raises ImportError saying why."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # copy, pickle and inspect probe for these: the usual answer
            raise AttributeError(name)
        raise ImportError(
            f"mobiuspipe._C.{name} needs the C++ extension, which did not load ({WHY_NOT}): "
            "build it with `python -m mobiuspipe._build`"
        )


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a torch version string ("2.11.0+cu130", "2.13.0a0+git1234": local tags aside)."""
    parts = [re.match(r"\d+", part) for part in version.split("+")[0].split(".")[:3]]
    return tuple(int(m.group()) if m else 0 for m in parts)


def _built_for_another_torch(module) -> str | None:
    """Why an extension that loaded must not be used: built against another torch release, whose ABI can load and
    then fail inside a call; None if it matches."""
    import torch

    built, running = tuple(getattr(module, "TORCH_VERSION", ())), _release(torch.__version__)
    if built == running:
        return None
    said = ".".join(map(str, built)) if built else "an unknown torch (a build older than this check)"
    return f"built against torch {said}, but this is torch {'.'.join(map(str, running))}"


try:
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    from mobiuspipe import _C

    if (_stale := _built_for_another_torch(_C)) is not None:
        raise ImportError(_stale)
    C = _C
    HAVE_C = True
    WHY_NOT = ""
except ImportError as exc:  # not built, built for another torch/Python (undefined symbol), or for another torch
    C = _Missing()
    HAVE_C = False
    WHY_NOT = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "mobiuspipe C++ extension not available, using the PyTorch fallback "
        f"(build it with `python -m mobiuspipe._build`): {WHY_NOT}",
        RuntimeWarning,
        stacklevel=2,
    )
