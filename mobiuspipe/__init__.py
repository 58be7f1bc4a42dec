"""mobiuspipe: fine-tune models larger than GPU memory with a pipeline of more stages than GPUs (Mobius)."""

from mobiuspipe.config import RunConfig, load_config

__version__ = "0.1.0"
__all__ = ["RunConfig", "load_config", "__version__"]
