"""A model spec by name: a built-in one (partition.spec.models) or a Hugging Face config.json (partition.spec.hf)."""

from __future__ import annotations

from pathlib import Path

from partition.errors import UnknownModelError
from partition.spec.hf import read_hf_config
from partition.spec.models import MODELS, ModelSpec

__all__ = ["get_model"]


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).exists()


def get_model(name: str) -> ModelSpec:
    """The spec called `name` (case-insensitive), else the HF config.json at path `name` (a file, or a folder
    holding one; see partition.spec.hf); UnknownModelError lists the known names."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in MODELS:
        return MODELS[key]
    if isinstance(name, str) and name.strip() and _looks_like_path(name.strip()):
        return read_hf_config(name.strip())
    raise UnknownModelError(
        f"unknown model {name!r}; known models: {', '.join(MODELS)}; "
        f"or give the path of a Hugging Face config.json (llama, mistral, qwen2, gpt2)"
    )
