"""PEFT's LoRA adapter folder: adapter_config.json (r, lora_alpha, lora_dropout, target_modules, use_rslora, ...)
and adapter_model.safetensors, whose keys are the base model's module names under "base_model.model." with
".lora_A.weight" / ".lora_B.weight" (no adapter name), as `PeftModel.save_pretrained` writes them and
`PeftModel.from_pretrained(base, DIR)` reads them. Only plain LoRA is read: no DoRA, no bias training, no
modules_to_save."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from foundation.files import fsync_files, fsync_folder
from mobiuspipe.errors import ConfigError
from mobiuspipe.lora.spec import LoraSpec

__all__ = ["CONFIG", "WEIGHTS", "PREFIX", "save_adapter", "load_adapter", "read_spec"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""What PEFT puts before a base model's module name in an adapter's keys."""


def save_adapter(
    folder: Path,
    spec: LoraSpec,
    tensors: dict[str, torch.Tensor],
    base_model: str,
    fan_in_fan_out: bool,
    extra: Mapping[str, str] | None = None,
) -> None:
    """Write an adapter (tensors: key without PREFIX -> tensor) for the base model at `base_model` into `folder`,
    with `extra` files (name -> text) beside, through a partial folder beside it renamed into place (replacing
    `folder`)."""
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "use_rslora": spec.rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file({PREFIX + k: t.detach().contiguous().cpu() for k, t in sorted(tensors.items())}, str(partial / WEIGHTS))
    for name, text in (extra or {}).items():
        (partial / name).write_text(text)
    fsync_files(partial)  # on the disk before it takes the name
    earlier = folder.with_name(f".{folder.name}.replaced")
    shutil.rmtree(earlier, ignore_errors=True)  # left by a crash between the renames below
    if folder.exists():  # moved aside, not removed, until the new one is in place
        folder.replace(earlier)
    partial.replace(folder)
    fsync_folder(folder.parent)
    shutil.rmtree(earlier, ignore_errors=True)


def load_adapter(folder: Path, key: str = "model.adapter") -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """An adapter folder's spec and tensors (keys without PREFIX); ConfigError naming `key` for a folder that is not
    a plain LoRA adapter."""
    return read_spec(folder, key), _weights(folder, key)


def read_spec(folder: Path, key: str = "model.adapter") -> LoraSpec:
    """An adapter folder's spec, from its adapter_config.json alone; ConfigError naming `key` for a folder that is
    not a plain LoRA adapter."""
    config = _config(folder, key)
    problems = [
        f"{name} {config.get(name)!r} (only {want!r} is read)"
        for name, want in (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False), ("modules_to_save", None))
        if config.get(name, want) != want
    ]
    targets = config.get("target_modules")
    if isinstance(targets, str):
        problems.append(f"target_modules {targets!r} (a regular expression; only a list of names is read)")
    if problems:
        raise ConfigError(
            f"{key}: expected a plain LoRA adapter, found in {folder / CONFIG}: {'; '.join(problems)}; fix: train a "
            f"plain LoRA adapter (peft LoraConfig with target_modules a list), or start a new adapter"
        )
    try:
        return LoraSpec(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            targets=tuple(targets or ()),
            dropout=float(config.get("lora_dropout") or 0.0),
            rslora=bool(config.get("use_rslora", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {folder / CONFIG} does not describe a LoRA adapter ({e}); fix: {_FIX}") from e


_FIX = "give a folder written by PeftModel.save_pretrained (adapter_config.json and adapter_model.safetensors)"


def _config(folder: Path, key: str) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{key}: expected an adapter folder, found {folder} without a readable {CONFIG} ({e}); fix: {_FIX}"
        ) from e
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {folder / CONFIG} is not a JSON object; fix: {_FIX}")
    return config


def _weights(folder: Path, key: str) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{key}: {path} is not a readable safetensors file ({e}); fix: {_FIX}") from e
    foreign = sorted(
        k for k in tensors if not k.startswith(PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight"))
    )
    if foreign:
        raise ConfigError(
            f"{key}: {path} holds tensors that are not LoRA A/B weights: {', '.join(foreign[:3])}; fix: {_FIX}"
        )
    return {k.removeprefix(PREFIX): t for k, t in tensors.items()}
