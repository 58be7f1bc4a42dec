"""A run's LoRA: its adapter spec (the lora section, or model.adapter's adapter_config.json), the adapter
parameters of each layer (counted on the model's own layers built on the meta device, so the plan counts what the
ranks train) and the saved adapter it continues."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from mobiuspipe.config import RunConfig
from mobiuspipe.errors import ConfigError
from mobiuspipe.lora.layers import Start, adapter_parameters, add_adapters, linear_names
from mobiuspipe.lora.peft_format import CONFIG, load_adapter, read_spec, save_adapter
from mobiuspipe.lora.spec import LoraSpec, matches
from mobiuspipe.models import gpt
from mobiuspipe.models.hf import HFModel, open_hf, skeleton
from mobiuspipe.models.hf_export import MARKER, adapter_layers, adapter_tensors, marker_text
from partition.spec.lora import LoraShape
from partition.spec.lora import adapter_kept as table_kept

__all__ = ["lora_spec", "default_targets", "adapter_counts", "adapter_kept", "starting_adapters", "write_adapter"]

PEFT_DEFAULTS = {"llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj")}
"""PEFT's target_modules when none are given, by model_type (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING);
GPT-2's is c_attn, the built-in GPT's the same layer, qkv."""


def _hf(cfg: RunConfig) -> HFModel | None:
    return open_hf(cfg.model.hf, cfg.model.seq_len) if cfg.model.hf else None


def default_targets(cfg: RunConfig) -> tuple[str, ...]:
    """PEFT's default targets for the config's model (see PEFT_DEFAULTS)."""
    hf = _hf(cfg)
    if hf is None:
        return ("qkv",)
    return PEFT_DEFAULTS.get(hf.model_type, ("c_attn",))


@lru_cache(maxsize=8)
def lora_spec(cfg: RunConfig) -> LoraSpec | None:
    """The adapters the run trains (None: every weight trains): the lora section's, or model.adapter's, which a
    lora key set to another value contradicts (ConfigError naming both). Read once per config: start-up asks for it
    from the plan, its checks, the banner and the FLOP count."""
    if not cfg.lora_on:
        return None
    mine = cfg.lora
    if cfg.model.adapter is None:
        assert mine.rank is not None  # lora_on
        targets = mine.targets or default_targets(cfg)
        alpha = float(mine.rank) if mine.alpha is None else mine.alpha
        return LoraSpec(
            rank=mine.rank,
            alpha=alpha,
            targets=targets,
            dropout=mine.dropout,
            rslora=mine.rslora,
            base_dtype=mine.base_dtype,
        )
    saved = read_spec(Path(cfg.model.adapter))
    given = {
        "rank": mine.rank,
        "alpha": mine.alpha,
        "targets": None if mine.targets is None else tuple(sorted(set(mine.targets))),
        "dropout": mine.dropout or None,
        "rslora": mine.rslora or None,
    }
    differ = [
        f"lora.{k} {v!r} (the adapter's: {getattr(saved, k)!r})"
        for k, v in given.items()
        if v is not None and v != getattr(saved, k)
    ]
    if differ:
        raise ConfigError(
            f"config {cfg.source}: expected the lora section to agree with model.adapter's "
            f"{Path(cfg.model.adapter) / CONFIG}, found {'; '.join(differ)}: remove those lora keys (the adapter "
            f"sets them), or drop model.adapter to start a new adapter"
        )
    return replace(saved, base_dtype=mine.base_dtype)  # how the base is kept: the run's choice, not the adapter's


def _meta_layer(cfg: RunConfig, hf: HFModel | None, l: int) -> nn.Module:
    with torch.device("meta"):
        return skeleton(hf, l) if hf is not None else gpt.skeleton(cfg.model.spec(), l)


BUILT_IN_NAMES = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "fc": "mlp.c_fc", "out": "mlp.c_proj", "lm": "lm_head"}
"""The built-in GPT's linear layers -> the names partition.spec.lora gives them (GPT-2's)."""


def adapter_kept(cfg: RunConfig, spec: LoraSpec, e: int, m: int) -> list[int]:
    """partition.spec.lora's k_l of each layer of the config's model in a dtype of e bytes, with dropout masks of m
    bytes an element: what its adapters keep for backward, less what its frozen base does not (a Hugging Face
    model's linear layers have the table's names; the built-in GPT's are translated)."""
    hf = _hf(cfg)
    if hf is not None:
        return table_kept(hf.spec, LoraShape(spec.rank, spec.targets, spec.dropout), e, m)
    targets = tuple(name for ours, name in BUILT_IN_NAMES.items() if matches(ours, spec.targets))
    return table_kept(cfg.model.spec(), LoraShape(spec.rank, targets, spec.dropout), e, m)


def adapter_counts(cfg: RunConfig, spec: LoraSpec) -> list[int]:
    """The adapter parameters `spec` adds to each layer of the config's model (the embedding, every block, the
    head), counted on its layers built on the meta device; ConfigError for a target that names none of its
    linear layers."""
    hf, last = _hf(cfg), cfg.model.num_layers - 1
    counts, names = {}, []
    for l in sorted({0, min(1, last), last}):  # the blocks are alike
        layer = _meta_layer(cfg, hf, l)
        names += [n.removeprefix("layer.") for n in linear_names(layer)]
        add_adapters(layer, spec)
        counts[l] = sum(p.numel() for p in adapter_parameters(layer).values())
    unknown = [t for t in spec.targets if not any(matches(n, (t,)) for n in names)]
    if unknown:
        key = "model.adapter's target_modules" if cfg.model.adapter else "lora.targets"
        linears = ", ".join(dict.fromkeys(names))
        raise ConfigError(
            f"config {cfg.source}: {key}: expected names of the model's linear layers ({linears}; a target names a "
            f"layer whose dotted name is it or ends with it), found {', '.join(unknown)}: "
            f"give some of those names"
        )
    return [counts[0]] + [counts[min(1, last)]] * (last - 1) + [counts[last]]


def starting_adapters(cfg: RunConfig, hf: HFModel | None) -> Start | None:
    """The saved adapter (model.adapter) the run continues, by layer and name (None: new adapters); ConfigError
    for a tensor that is no layer's of the model."""
    if cfg.model.adapter is None or hf is None:
        return None
    folder = Path(cfg.model.adapter)
    _, tensors = load_adapter(folder)
    try:
        return adapter_layers(hf, tensors)
    except KeyError as e:
        raise ConfigError(
            f"config {cfg.source}: model.adapter: expected the tensors of an adapter of {cfg.model.hf}, found "
            f"{e.args[0]} in {folder}: give an adapter saved for this model"
        ) from e


def write_adapter(
    hf: HFModel, spec: LoraSpec, state: dict[str, torch.Tensor], to: Path, dtype: torch.dtype, owner: str
) -> None:
    """PEFT's adapter folder at `to` of the adapters in `state` (a pipeline's "layer.name" weights: every rank's,
    the base left out or not) in `dtype`, marked as `owner`'s export, which PeftModel.from_pretrained loads onto
    model.hf."""
    tensors = {k: v.to(dtype) for k, v in adapter_tensors(hf, state).items()}
    fan_in_fan_out = hf.model_type == "gpt2"  # Conv1D: PEFT's flag for a [in, out] base weight
    save_adapter(to, spec, tensors, str(hf.folder), fan_in_fan_out=fan_in_fan_out, extra={MARKER: marker_text(owner)})
