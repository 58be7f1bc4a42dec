"""mobiuspipe: fine-tune models larger than GPU memory with a pipeline of more stages than GPUs (Mobius).

The public API: Pipeline (train your layers), Plan / make_plan / load_plan (the plans it follows),
RunConfig / load_config (the torchrun entry's YAML). Names load on first use, so that the CLI starts
without importing torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# torchao (mobiuspipe.lora.quant's NF4; transformers imports it too when it is installed) logs each of its CUDA
# kernels that a build cannot load, and registers types that torch's pytree warns about: noise, not news, for a
# run that uses its NF4 alone (plain PyTorch ops). Set before anything imports torchao.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_EXPORTS = {
    "Pipeline": "mobiuspipe.pipeline",
    "StepResult": "mobiuspipe.pipeline",
    "Plan": "partition.plan",
    "make_plan": "partition",
    "load_plan": "partition.plan",
    "RunConfig": "mobiuspipe.config",
    "load_config": "mobiuspipe.config",
    "LoraSpec": "mobiuspipe.lora.spec",
}
__all__ = [
    "Pipeline",
    "StepResult",
    "Plan",
    "make_plan",
    "load_plan",
    "RunConfig",
    "load_config",
    "LoraSpec",
    "__version__",
]

if TYPE_CHECKING:
    from mobiuspipe.config import RunConfig, load_config
    from mobiuspipe.lora.spec import LoraSpec
    from mobiuspipe.pipeline import Pipeline, StepResult
    from partition import make_plan
    from partition.plan import Plan, load_plan


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mobiuspipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
