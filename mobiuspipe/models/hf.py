"""Hugging Face causal LMs (GPT-2, Llama, Mistral, Qwen2) from a local folder, cut into pipeline layers.

The folder is what `save_pretrained` writes: config.json and the weights, model.safetensors or shards
listed in model.safetensors.index.json. Nothing is downloaded. Layers, each one tensor in, one out:
  0        the token embedding (GPT-2: + the position table, then dropout): ids (b, T) -> (b, T, d)
  1..L     decoder layer l - 1, transformers' own class; positions 0..T-1, causal attention through
           PyTorch's SDPA (transformers' SDPA function; in fp32 with grouped queries, the key/value heads
           repeated first: `ATTENTION`) (Llama family: the rotary tables computed in each layer)
  L + 1    the final norm and the vocabulary projection: (b, T, d) -> logits (b, T, V)
Each layer is built on the meta device and then materialized with only its own tensors, read from the
safetensors files (mobiuspipe.models.hf_weights), so a rank reads the layers of its stages alone. With
tie_word_embeddings the head keeps its own copy of the embedding table and `tied_params` names the pair
for the Pipeline, which sums their gradients before both update alike.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mobiuspipe.models.hf_weights import check_tensors, hf_key, layer_key, load_layer, tensor_files
from partition.spec.hf import ModelConfigError, read_hf_config
from partition.spec.models import ModelSpec

__all__ = ["HFModel", "SUPPORTED", "open_hf", "skeleton", "layer_factories", "hf_key", "layer_key"]

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2")
"""The model_types the runtime trains."""
_LLAMA_FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
"""model_type -> the class-name prefix in transformers.models.{model_type}.modeling_{model_type}."""


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face model folder, read and checked: its config, spec and where each tensor is stored."""

    folder: Path
    config: Any
    """The transformers PretrainedConfig (attention set to SDPA)."""
    spec: ModelSpec
    """The partition package's description (seq_len = the training sequence length)."""
    files: dict[str, Path]
    """Checkpoint tensor name -> the safetensors file holding it."""

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def num_layers(self) -> int:
        """Embedding + decoder layers + head."""
        return self.spec.num_layers

    @property
    def tied(self) -> bool:
        """The head's projection is the token embedding table (tie_word_embeddings)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tied_params(self) -> list[tuple[str, str]]:
        """The ("layer.name", "layer.name") pairs that are one parameter in the checkpoint."""
        if not self.tied:
            return []
        embed = "wte.weight" if self.model_type == "gpt2" else "embed_tokens.weight"
        return [(f"0.{embed}", f"{self.num_layers - 1}.lm_head.weight")]


def open_hf(folder: str | os.PathLike, seq_len: int) -> HFModel:
    """Read and check a model folder for training on sequences of seq_len tokens (ModelConfigError names
    what is wrong and the fix)."""
    from transformers import AutoConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelConfigError(
            f"model.hf: {path} has no config.json; expected a folder written by save_pretrained "
            f"(config.json and model.safetensors)"
        )
    spec = read_hf_config(path)  # checks model_type and the shape keys, naming the file and key
    files = tensor_files(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    _register_attention()
    config._attn_implementation = ATTENTION  # causal through SDPA's is_causal: the layers get no mask
    _check_trainable(config, seq_len, path)
    m = HFModel(path, config, replace(spec, seq_len=seq_len), files)
    check_tensors(m, [_shapes(m, l) for l in range(m.num_layers)])  # the headers only: no weight is read
    return m


ATTENTION = "mobiuspipe_sdpa"
"""The name the layers' attention function has in transformers' AttentionInterface (see `_sdpa`)."""


def _sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
    """transformers' SDPA attention, with fewer key/value heads than query heads repeated first in fp32: on CUDA the
    kernels that take fp32 are the memory-efficient one, which refuses grouped queries, and the math one, which keeps
    the (b, a, s, s) probabilities for backward (torch's sdp_utils); repeated, the memory-efficient one runs, keeping
    K and V at every head. fp16 and bf16 keep the grouped heads (the flash kernel takes them)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = query.shape[1] // key.shape[1]
    if query.dtype == torch.float32 and groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _sdpa)


def _shapes(m: HFModel, l: int) -> dict[str, tuple[int, ...]]:
    """Layer l's parameter name -> the shape config.json implies."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in skeleton(m, l).named_parameters()}


def _check_trainable(config, seq_len: int, path: Path) -> None:
    where = f"model.hf {path / 'config.json'}"
    positions = config.n_positions if config.model_type == "gpt2" else config.max_position_embeddings
    if seq_len > positions:
        raise ModelConfigError(
            f"{where}: model.seq_len {seq_len} exceeds the model's {positions} positions; use model.seq_len "
            f"<= {positions}"
        )
    window = _sliding_window(config)
    if window is not None and seq_len > window:
        raise ModelConfigError(
            f"{where}: sliding-window attention over {window} tokens with model.seq_len {seq_len}: the pipeline "
            f"trains full causal attention only; use model.seq_len <= {window}"
        )
    if getattr(config, "add_cross_attention", False):
        raise ModelConfigError(f"{where}: add_cross_attention is true; only decoder-only models are supported")


def _sliding_window(config) -> int | None:
    if config.model_type == "mistral":
        return config.sliding_window
    if config.model_type == "qwen2" and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return config.sliding_window
    return None


class TokenEmbedding(nn.Module):
    """Layer 0 of a Llama-family model: token ids (b, T) -> hidden states (b, T, d)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class GPT2Embedding(nn.Module):
    """Layer 0 of GPT-2: token + position embeddings, then dropout (as GPT2Model does)."""

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))


class DecoderLayer(nn.Module):
    """One transformers decoder layer on positions 0..T-1 (causal); `rotary` makes the Llama family's
    cos/sin tables (kept out of the module's buffers: it is rebuilt per device, never trained or saved)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.layer = layer
        self._rotary = {} if rotary is None else {torch.device("cpu"): rotary}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._rotary:
            return _hidden(self.layer(x))
        pos = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self._rotary_on(x.device)(x, pos)
        return _hidden(self.layer(x, position_ids=pos, position_embeddings=(cos, sin)))

    def _rotary_on(self, device: torch.device) -> nn.Module:
        """The rotary module on `device`: a copy of the first one (Module.to moves a module in place)."""
        if device not in self._rotary:
            self._rotary[device] = copy.deepcopy(next(iter(self._rotary.values()))).to(device)
        return self._rotary[device]


def _hidden(out) -> torch.Tensor:
    """The hidden states of a decoder layer's output (a tensor, or a tuple led by one in older releases)."""
    return out[0] if isinstance(out, tuple) else out


class NormHead(nn.Module):
    """The last layer: final norm and the vocabulary projection (b, T, d) -> logits (b, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def skeleton(m: HFModel, l: int) -> nn.Module:
    """Layer l with uninitialized weights (build it under torch.device("meta"))."""
    c, last = m.config, m.num_layers - 1
    if m.model_type == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        if l == 0:
            return GPT2Embedding(c)
        if l < last:
            return DecoderLayer(GPT2Block(c, layer_idx=l - 1), None)
        return NormHead(nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon), nn.Linear(c.n_embd, c.vocab_size, False))
    prefix = _LLAMA_FAMILY[m.model_type]
    mod = import_module(f"transformers.models.{m.model_type}.modeling_{m.model_type}")
    if l == 0:
        return TokenEmbedding(c)
    if l < last:
        with torch.device("cpu"):  # the rotary table's inv_freq is computed, not loaded
            rotary = _static_rope(getattr(mod, f"{prefix}RotaryEmbedding")(config=c))
        return DecoderLayer(getattr(mod, f"{prefix}DecoderLayer")(c, layer_idx=l - 1), rotary)
    norm = getattr(mod, f"{prefix}RMSNorm")(c.hidden_size, eps=c.rms_norm_eps)
    return NormHead(norm, nn.Linear(c.hidden_size, c.vocab_size, bias=False))


def _static_rope(rotary: nn.Module) -> nn.Module:
    """rotary, without dynamic rope's check in every forward. transformers' dynamic rope reads max(position_ids) + 1
    on the host twice a forward (on CUDA a wait for the compute stream each) to grow its table past
    max_position_embeddings; a pipeline's sequences never pass it (open_hf refuses them), where the table is the
    default one, so the check is dropped (its type, which the check reads, named default)."""
    if "dynamic" in str(getattr(rotary, "rope_type", "")):
        rotary.rope_type = "default"  # pyright: ignore  (a plain str attribute of transformers' rotary module)
    return rotary


def build_layer(m: HFModel, l: int) -> nn.Module:
    """Layer l, materialized on the CPU in fp32 with its tensors read from the checkpoint."""

    with torch.device("meta"):
        layer = skeleton(m, l)
    layer.to_empty(device="cpu")
    load_layer(m, l, layer)
    return layer


def layer_factories(m: HFModel) -> list[Callable[[], nn.Module]]:
    """One factory per layer, so that a Pipeline rank reads only the layers of its own stages."""
    return [partial(build_layer, m, l) for l in range(m.num_layers)]
