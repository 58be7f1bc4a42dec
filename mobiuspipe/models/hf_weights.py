"""The safetensors side of a Hugging Face model folder: where each tensor is, and reading one layer's tensors.

Checkpoint names are looked up as save_pretrained writes them ("model.layers.0.mlp.up_proj.weight") and
without the base model's prefix ("h.0.attn.c_attn.weight", as GPT-2's original checkpoint has them). A
tied head reads the embedding table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from partition.spec.hf import ModelConfigError

__all__ = ["tensor_files", "check_tensors", "load_layer", "hf_key", "INDEX", "SINGLE"]

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
        try:
            with safe_open(str(single), "pt") as f:
                return dict.fromkeys(f.keys(), single)
        except (OSError, SafetensorError) as e:
            raise ModelConfigError(
                f"model.hf: {single} is not a readable safetensors file ({e}); expected the file save_pretrained "
                f"writes: copy it again (a truncated copy fails so) or re-save the model"
            ) from e
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


def layer_key(m, key: str) -> tuple[int, str]:
    """The layer and its parameter's name that checkpoint name `key` of model m is (the inverse of hf_key)."""
    base, blocks = ("transformer", "h") if m.model_type == "gpt2" else ("model", "layers")
    final = f"{base}.{'ln_f' if m.model_type == 'gpt2' else 'norm'}."
    if key.startswith(f"{base}.{blocks}."):
        index, _, rest = key.removeprefix(f"{base}.{blocks}.").partition(".")
        if index.isdigit() and 0 <= int(index) < m.num_layers - 2 and rest:
            return int(index) + 1, f"layer.{rest}"
        raise KeyError(f"{key} names block {index}, which {m.folder} has not (it has {m.num_layers - 2} blocks)")
    if key.startswith(final):
        return m.num_layers - 1, "norm." + key.removeprefix(final)
    if key.startswith(f"{base}."):
        return 0, key.removeprefix(f"{base}.")
    return m.num_layers - 1, key


def _sources(m, l: int, names) -> dict[str, tuple[str, str | None]]:
    """Layer l's parameter name -> (its checkpoint name, the stored name or None when the checkpoint lacks it)."""
    embed = {hf_key(m, 0, a.split(".", 1)[1]) for a, _ in m.tied_params()}
    found = {}
    for name in names:
        key = hf_key(m, l, name)
        if l == m.num_layers - 1 and name == "lm_head.weight" and embed and _source(m, key) is None:
            key = next(iter(embed))  # tied: save_pretrained stores the table once, as the embedding
        found[name] = (key, _source(m, key))
    return found


def check_tensors(m, shapes: list[dict[str, tuple[int, ...]]]) -> None:
    """Every layer's parameters (shapes[l]: name -> the shape config.json implies) stored in the checkpoint with
    that shape, read from the safetensors headers alone; ModelConfigError naming every problem at once."""
    missing, wanted = [], {}
    for l, layer in enumerate(shapes):
        for name, (key, src) in _sources(m, l, layer).items():
            if src is None:
                missing.append(f"{key!r} (layer {l}, {name})")
            else:
                wanted[src] = layer[name]
    stored, unreadable = _stored_shapes(m, wanted)
    other = [
        f"{src!r} of shape {stored[src]} for {shape}"
        for src, shape in wanted.items()
        if stored.get(src, shape) != shape
    ]
    missing += [f"{src!r} (in the index, not in {m.files[src].name})" for src in wanted if src not in stored]
    missing = [] if unreadable else missing  # an unreadable file's tensors are not missing
    parts = [
        f"{len(found)} {what}: {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}"
        for what, found in (
            ("unreadable file(s)", unreadable),
            ("tensor(s) missing", missing),
            ("of another shape", other),
        )
        if found
    ]
    if parts:
        raise ModelConfigError(
            f"model.hf: the checkpoint in {m.folder} does not match its config.json: {'; '.join(parts)}; expected "
            f"every tensor config.json implies, in readable safetensors files: copy the folder again (a truncated "
            f"copy reads so) or re-save the model with save_pretrained"
        )


def _stored_shapes(m, names) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The stored shape of each of `names` whose file holds it, from the headers; the files that cannot be read."""
    stored, unreadable = {}, []
    for file, srcs in _by_file(m, names).items():
        try:
            with safe_open(str(file), "pt") as f:
                held = set(f.keys())
                stored.update({src: tuple(f.get_slice(src).get_shape()) for src in srcs if src in held})
        except (OSError, SafetensorError) as e:
            unreadable.append(f"{file.name} ({e})")
    return stored, unreadable


def _by_file(m, names) -> dict[Path, list[str]]:
    """Stored tensor names grouped by the safetensors file that holds them (each file opened once)."""
    out: dict[Path, list[str]] = {}
    for src in names:
        out.setdefault(m.files[src], []).append(src)
    return out


def load_layer(m, l: int, layer: nn.Module) -> None:
    """Fill layer l's parameters (fp32, on the CPU) from the checkpoint; ModelConfigError for a tensor that
    is missing or of another shape."""
    params = dict(layer.named_parameters())
    wanted = {}
    for name, (key, src) in _sources(m, l, params).items():
        if src is None:
            raise ModelConfigError(
                f"model.hf: the checkpoint in {m.folder} has no tensor {key!r} (layer {l}, {name}); it does not "
                f"match its config.json: re-save the model with save_pretrained"
            )
        wanted[src] = params[name]
    with torch.no_grad():
        for file, names in _by_file(m, wanted).items():
            for src, t in _read(file, names):
                p = wanted[src]
                if t.shape != p.shape:
                    raise ModelConfigError(
                        f"model.hf: {file.name} holds {src!r} of shape {tuple(t.shape)}, config.json implies "
                        f"{tuple(p.shape)}; the weights belong to another config"
                    )
                p.copy_(t)


def _read(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each of `names` in a safetensors file, opened once; ModelConfigError when the file no
    longer holds one (changed since the run checked it)."""
    src = names[0]
    try:
        with safe_open(str(file), "pt") as f:
            for src in names:
                yield src, f.get_tensor(src)
    except (OSError, SafetensorError) as e:
        raise ModelConfigError(
            f"model.hf: cannot read {src!r} from {file.name} ({e}): the file changed after the run checked it; "
            f"copy the model folder again and restart"
        ) from e
