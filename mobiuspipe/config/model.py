"""The run config's `model:` section: a Hugging Face model folder, or the built-in GPT's shape."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from foundation.loader import Problem, at_least, rule
from mobiuspipe.config.section import Section, divisible
from partition.spec.hf import ModelConfigError, read_hf_config
from partition.spec.models import ModelSpec

MAX_VOCAB = 65536
"""Largest vocabulary of the built-in GPT: its byte-level and token-file ids fit in 16 bits."""
SHAPE_KEYS = ("vocab_size", "num_blocks", "d_model", "num_heads")
"""The built-in GPT's shape: a Hugging Face model's config.json sets these instead."""


@lru_cache(maxsize=8)
def _hf_spec(folder: str) -> ModelSpec:
    """The spec of a Hugging Face model folder's config.json (read once per process)."""
    return read_hf_config(folder)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Section):
    """The model: a Hugging Face model folder (`hf`), or the built-in GPT (one embedding layer, `num_blocks`
    transformer blocks, one head) of the shape the other keys give."""

    hf: str | None = field(
        default=None,
        metadata={"folder_fix": "give a folder written by save_pretrained (config.json + model.safetensors)"},
    )
    """A Hugging Face model folder (GPT-2, Llama, Mistral or Qwen2: config.json and safetensors weights, as
    save_pretrained writes them) to fine-tune from its weights; relative to the config file's folder. Its
    config.json sets the shape: vocab_size, num_blocks, d_model and num_heads are left out (set beside hf, they
    are refused: they would not be read). None =
    the built-in GPT, initialized from train.seed."""
    adapter: str | None = field(
        default=None,
        metadata={
            "folder_fix": "give a folder written by PeftModel.save_pretrained (adapter_config.json and "
            "adapter_model.safetensors), or remove model.adapter to start a new adapter"
        },
    )
    """A saved PEFT LoRA adapter of model.hf to continue training (a folder with adapter_config.json and
    adapter_model.safetensors, as PeftModel.save_pretrained or a LoRA run's export writes it), relative to the
    config file's folder; its adapter_config.json gives the lora section's rank, alpha, dropout, targets and
    rslora (a lora key set to another value is refused). None = new adapters (with lora.rank) or none."""
    vocab_size: int = 256
    """Distinct token ids (count); 256 = byte-level tokens, one per byte value; at most 65536."""
    num_blocks: int = 6
    """Transformer blocks (count); the model has num_blocks + 2 layers: embedding, blocks, head."""
    d_model: int = 64
    """Width of the hidden state (features per token); a multiple of num_heads."""
    num_heads: int = 4
    """Attention heads per block (count); each head gets d_model // num_heads features."""
    seq_len: int = 64
    """Context length: tokens per training sequence (tokens)."""

    @property
    def num_layers(self) -> int:
        """Layers the partitioner can cut between: embedding + blocks + head."""
        return self.spec().num_layers

    def spec(self) -> ModelSpec:
        """The partition package's description of the model (hf: read from its config.json)."""
        if self.hf is not None:
            return replace(_hf_spec(self.hf), seq_len=self.seq_len)
        return ModelSpec(
            name=f"gpt-{self.num_blocks}x{self.d_model}",
            num_blocks=self.num_blocks,
            d_model=self.d_model,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
        )

    @property
    def model_vocab_size(self) -> int:
        """Token ids the model takes: its config.json's vocab_size with hf, else vocab_size."""
        return self.spec().vocab_size

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.d_model // self.num_heads

    def check_values(self) -> list[Problem]:
        return [
            *rule(
                1 <= self.vocab_size <= MAX_VOCAB,
                "vocab_size",
                f"an integer in 1..{MAX_VOCAB}",
                repr(self.vocab_size),
                "use 256 for byte-level tokens",
            ),
            *at_least(self, "num_blocks", 1, "use at least 1 transformer block"),
            *at_least(self, "d_model", 1, "use a width such as 64"),
            *at_least(self, "num_heads", 1, "use at least 1 attention head"),
            *at_least(self, "seq_len", 1, "use a context length such as 64"),
            *divisible("d_model", self.d_model, "num_heads", self.num_heads),
            *self._hf_problems(),
        ]

    def _hf_problems(self) -> list[Problem]:
        """With hf: its config.json must describe a model mobiuspipe can cut (read once, as spec() reads it), and no
        shape key is set beside it (it would be ignored: config.json sets the shape)."""
        if self.hf is None:
            return []
        shape = [k for k in SHAPE_KEYS if getattr(self, k) != getattr(ModelConfig, k)]
        if shape:
            given = ", ".join(f"{k}: {getattr(self, k)}" for k in shape)
            return [
                Problem(
                    shape[0],
                    f"no {' or '.join(shape)} beside model.hf (its config.json sets the model's shape)",
                    given,
                    f"remove {', '.join(shape)} from the model section, or drop model.hf to train the built-in GPT",
                )
            ]
        try:
            _hf_spec(self.hf)
        except ModelConfigError as e:
            fix = "give a folder written by save_pretrained (config.json + model.safetensors) of a supported model"
            return [
                Problem("hf", "a Hugging Face model folder whose config.json describes a supported model", str(e), fix)
            ]
        return []
