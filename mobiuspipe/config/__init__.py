"""The run's YAML, typed: one checked dataclass per section (`run` holds the whole and its loader)."""

from mobiuspipe.config.data import DataConfig
from mobiuspipe.config.lora import LoraConfig
from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.config.model import ModelConfig
from mobiuspipe.config.run import DEFAULT_GPUS, PlanConfig, RunConfig, TrainConfig, config_from_dict, load_config
from mobiuspipe.config.runtime import RuntimeConfig
from mobiuspipe.errors import ConfigError

__all__ = [
    "ConfigError",
    "DEFAULT_GPUS",
    "DataConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "PlanConfig",
    "RunConfig",
    "RuntimeConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
]
