"""Loads the optional C++ extension mobiuspipe._C; HAVE_C says whether it is there (else PyTorch fallbacks)."""

from __future__ import annotations

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


try:
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    from mobiuspipe import _C as C

    HAVE_C = True
    WHY_NOT = ""
except ImportError as exc:  # not built, or built for another torch/Python (undefined symbol)
    C = _Missing()
    HAVE_C = False
    WHY_NOT = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "mobiuspipe C++ extension not available, using the PyTorch fallback "
        f"(build it with `python -m mobiuspipe._build`): {WHY_NOT}",
        RuntimeWarning,
        stacklevel=2,
    )
