"""Fine-tuned weights written back as a Hugging Face folder that `from_pretrained` loads: one safetensors
shard per stage (each rank writes its own), the index, config.json (with the saved dtype) and the source
folder's tokenizer and generation files.

A tied head's copy is left out (save_pretrained stores the table once, as the embedding; from_pretrained
ties them again). The folder is written beside its destination and renamed into place when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from foundation.files import fsync_files, fsync_folder
from mobiuspipe.errors import ConfigError
from mobiuspipe.models.hf import HFModel, hf_key, layer_key
from mobiuspipe.models.hf_weights import INDEX

__all__ = [
    "SIDE_FILES",
    "SIDE_FOLDERS",
    "MARKER",
    "marker_text",
    "check_export_dir",
    "partial_dir",
    "write_shard",
    "finish_export",
    "adapter_tensors",
    "adapter_layers",
]

SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files of the source folder an export copies as they are (those present): the generation settings and the
tokenizer's files, its chat template included (transformers 5 keeps it in chat_template.jinja, 4.x in
tokenizer_config.json or chat_template.json), and its named extra templates (SIDE_FOLDERS)."""
SIDE_FOLDERS = ("additional_chat_templates",)
"""Folders of the source an export copies whole (those present)."""
MARKER = "mobiuspipe-export.json"
"""The file an export writes beside the weights: {"owner": the run that wrote it (its out_dir, or the export's own
path for `mobiuspipe export`)}. A later export of the same owner replaces the folder; nothing else does."""


def check_export_dir(to: Path, key: str, owner: str | None = None) -> None:
    """An export may go to a new or empty folder, or replace one that an export of the same `owner` wrote
    (a finished run extended or resumed); ConfigError naming `key` otherwise."""
    if to.exists() and (not to.is_dir() or any(to.iterdir())) and not _owned_by(to, owner):
        mine = f" (it was not written by this run, {owner})" if owner is not None and (to / MARKER).is_file() else ""
        raise ConfigError(
            f"{key}: {to} exists and is not an empty folder{mine}; the export will not overwrite it: give a new "
            f"folder or remove it"
        )
    parent = to.parent if to.parent.exists() else None
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{key}: {to.parent} is not a folder; give a path inside a folder")


def marker_text(owner: str) -> str:
    """The text of an export's MARKER file naming its owner (check_export_dir reads it)."""
    return json.dumps({"owner": owner}) + "\n"


def _owned_by(to: Path, owner: str | None) -> bool:
    """Whether folder `to` holds an export whose marker names `owner`."""
    try:
        return owner is not None and json.loads((to / MARKER).read_text()).get("owner") == owner
    except (OSError, ValueError, AttributeError):
        return False


def partial_dir(to: Path) -> Path:
    """Where the export is written before it is renamed to `to`."""
    return to.with_name(f".{to.name}.partial")


def shard_name(j: int, num_stages: int) -> str:
    return f"model-{j + 1:05d}-of-{num_stages:05d}.safetensors"


def write_shard(
    m: HFModel, j: int, num_stages: int, weights: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype
) -> dict[str, int]:
    """Write stage j's weights ("layer.name" -> tensor) as its shard in `folder`; returns checkpoint name ->
    bytes of what it wrote."""
    heads = {b for _, b in m.tied_params()}
    out = {}
    for key, t in weights.items():
        l, name = key.split(".", 1)
        if key not in heads:
            out[hf_key(m, int(l), name)] = t.detach().to("cpu", dtype).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / shard_name(j, num_stages)), metadata={"format": "pt"})
    return {k: t.numel() * t.element_size() for k, t in out.items()}


def finish_export(
    m: HFModel, shards: dict[int, dict[str, int]], num_stages: int, to: Path, dtype: torch.dtype, owner: str
) -> None:
    """Write the index (from every stage's names and bytes), config.json, the side files and the MARKER naming
    `owner` next to the shards in partial_dir(to), then rename it to `to`; an earlier export of the same owner
    there is set aside first and removed once the new one is in place."""
    folder = partial_dir(to)
    missing = [j for j in range(num_stages) if j not in shards]
    if missing:
        raise RuntimeError(f"export to {to}: no shard was written for stages {missing}")
    weight_map = {k: shard_name(j, num_stages) for j, names in shards.items() for k in names}
    total = sum(b for names in shards.values() for b in names.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((m.folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for side in SIDE_FILES:
        if (m.folder / side).is_file():
            shutil.copy2(m.folder / side, folder / side)
    for side in SIDE_FOLDERS:
        if (m.folder / side).is_dir():
            shutil.copytree(m.folder / side, folder / side)
    (folder / MARKER).write_text(marker_text(owner))
    fsync_files(folder)  # the new export is on the disk before it takes the name and the old one goes
    earlier = to.with_name(f".{to.name}.replaced")
    shutil.rmtree(earlier, ignore_errors=True)  # left by a run that stopped between the two renames
    if to.exists():
        to.replace(earlier)  # empty, or an export of this owner (check_export_dir)
    folder.replace(to)
    fsync_folder(to.parent)
    shutil.rmtree(earlier, ignore_errors=True)


ADAPTER_PARTS = (".lora_A.", ".lora_B.")
"""What names a LoRA adapter's parameter (mobiuspipe.lora.layers), in a "layer.name" key."""


def adapter_tensors(m: HFModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a pipeline's state_dict() ("layer.name" -> tensor, every layer or some) under their
    checkpoint names ("model.layers.0.self_attn.q_proj.lora_A.weight"), as PEFT's adapter folder keys them
    (mobiuspipe.lora.peft_format.save_adapter adds its prefix)."""
    out = {}
    for key, t in state.items():
        layer, name = key.split(".", 1)
        if any(part in f".{name}" for part in ADAPTER_PARTS):
            out[hf_key(m, int(layer), name)] = t
    return out


def adapter_layers(m: HFModel, tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """A saved adapter's tensors (checkpoint names, as adapter_tensors gives them) by layer and name in the layer:
    what Pipeline(adapters=...) continues; KeyError for a name that is no layer's of model m."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        l, name = layer_key(m, key)
        out.setdefault(l, {})[name] = t
    return out
