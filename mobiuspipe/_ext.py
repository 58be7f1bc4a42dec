"""Loads the optional C++ extension mobiuspipe._C; HAVE_C says whether it is there (else PyTorch fallbacks)."""

from __future__ import annotations

import warnings

try:
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    from mobiuspipe import _C as C
    HAVE_C = True
    WHY_NOT = ""
except ImportError as exc:  # not built, or built for another torch/Python (undefined symbol)
    C = None
    HAVE_C = False
    WHY_NOT = f"{type(exc).__name__}: {exc}"
    warnings.warn("mobiuspipe C++ extension not available, using the PyTorch fallback "
                  f"(build it with `python -m mobiuspipe._build`): {WHY_NOT}", RuntimeWarning, stacklevel=2)
