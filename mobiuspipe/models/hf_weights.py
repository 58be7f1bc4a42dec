"""The safetensors side of a Hugging Face model folder: where each tensor is, and reading one layer's tensors.

Checkpoint names are looked up as save_pretrained writes them ("model.layers.0.mlp.up_proj.weight") and
without the base model's prefix ("h.0.attn.c_attn.weight", as GPT-2's original checkpoint has them). A
tied head reads the embedding table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from partition.spec.hf import ModelConfigError

__all__ = ["tensor_files", "load_layer", "hf_key", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> its safetensors file, from the index of a sharded checkpoint or the keys of
    model.safetensors."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelConfigError(
                f"model.hf: {index} is not a safetensors index ({type(e).__name__}: {e}); expected a JSON object "
                f'with a "weight_map" of tensor name -> file, as save_pretrained writes it'
            ) from e
        files = {k: folder / f for k, f in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ModelConfigError(
                f"model.hf: {index} lists {len(missing)} shard(s) that are not there: {', '.join(missing[:3])}; "
                f"copy the whole folder"
            )
        return files
    single = folder / SINGLE
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise ModelConfigError(
        f"model.hf: {folder} has no {SINGLE} or {INDEX} (found: {', '.join(found) or 'no weight files'}); "
        f"save the model with save_pretrained(folder) (safetensors, the default) or convert its weights"
    )


def _source(m, name: str) -> str | None:
    """The stored name of checkpoint tensor `name`: as is, or without the base model's prefix."""
    if name in m.files:
        return name
    bare = name.split(".", 1)[1] if "." in name else name
    return bare if bare in m.files else None


def hf_key(m, l: int, name: str) -> str:
    """The checkpoint's name of layer l's parameter `name` of model m (an HFModel: its model_type and num_layers),
    as save_pretrained writes it."""
    base, blocks = ("transformer", "h") if m.model_type == "gpt2" else ("model", "layers")
    if l == 0:
        return f"{base}.{name}"
    if l < m.num_layers - 1:
        return f"{base}.{blocks}.{l - 1}.{name.removeprefix('layer.')}"
    if name.startswith("norm."):
        final = "ln_f" if m.model_type == "gpt2" else "norm"
        return f"{base}.{final}.{name.removeprefix('norm.')}"
    return name  # lm_head.weight


def load_layer(m, l: int, layer: nn.Module) -> None:
    """Fill layer l's parameters (fp32, on the CPU) from the checkpoint; ModelConfigError for a tensor that
    is missing or of another shape."""

    embed = {hf_key(m, 0, a.split(".", 1)[1]) for a, _ in m.tied_params()}
    wanted = {}
    for name, p in layer.named_parameters():
        key = hf_key(m, l, name)
        if l == m.num_layers - 1 and name == "lm_head.weight" and embed and _source(m, key) is None:
            key = next(iter(embed))  # tied: save_pretrained stores the table once, as the embedding
        src = _source(m, key)
        if src is None:
            raise ModelConfigError(
                f"model.hf: the checkpoint in {m.folder} has no tensor {key!r} (layer {l}, {name}); it does not "
                f"match its config.json: re-save the model with save_pretrained"
            )
        wanted[src] = p
    by_file: dict[Path, list[str]] = {}
    for src in wanted:
        by_file.setdefault(m.files[src], []).append(src)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), "pt") as f:
                for src in names:
                    t, p = f.get_tensor(src), wanted[src]
                    if t.shape != p.shape:
                        raise ModelConfigError(
                            f"model.hf: {file.name} holds {src!r} of shape {tuple(t.shape)}, config.json implies "
                            f"{tuple(p.shape)}; the weights belong to another config"
                        )
                    p.copy_(t)
