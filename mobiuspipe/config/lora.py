"""The run config's `lora:` section: train LoRA adapters beside the model's frozen weights (rank, alpha, dropout,
target modules as PEFT's target_modules), or, with no rank, train every weight."""

from __future__ import annotations

from dataclasses import dataclass

from foundation.loader import Problem, found_text, rule
from mobiuspipe.config.section import Section
from partition.spec.lora import BASE_DTYPES

__all__ = ["LoraConfig"]


@dataclass(frozen=True, kw_only=True)
class LoraConfig(Section):
    """LoRA fine-tuning: rank-r adapters train beside each target linear layer, whose weights, like every other
    weight of the model, are frozen (streamed read-only: no gradient, no offload, no optimizer state). With
    model.adapter the run continues that saved adapter, whose adapter_config.json gives these values."""

    rank: int | None = None
    """The adapters' rank r (count, >= 1); null = no LoRA: every weight trains (full fine-tuning), unless
    model.adapter gives one."""
    alpha: float | None = None
    """The adapters' output is scaled by alpha / r (alpha / sqrt(r) with rslora); null = r (a scale of 1;
    PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (a probability in [0, 1); PEFT's lora_dropout)."""
    targets: tuple[str, ...] | None = None
    """The linear layers that get adapters, named as PEFT's target_modules: a layer whose dotted name is a target
    or ends with "." and a target (e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj] for a
    Llama, [c_attn] for GPT-2, [qkv, proj, fc, out] for the built-in GPT); null = PEFT's default for the model
    (q_proj and v_proj for Llama, Mistral and Qwen2, c_attn for GPT-2, qkv for the built-in GPT)."""
    rslora: bool = False
    """Rank-stabilized LoRA: scale by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."""
    base_dtype: str | None = None
    """How the frozen base is kept in host memory and copied to the gpus: null = train.precision; "int8" = a byte
    per weight of each linear layer and a float32 scale per output feature (torchao's weight-only int8); "nf4" =
    QLoRA's 4-bit NormalFloat (torchao's), about 0.52 bytes per weight of each linear layer whose size 16,384
    divides; both dequantized on the gpu just before use (mobiuspipe/lora/quant.py)."""

    @property
    def on(self) -> bool:
        """Whether this section asks for LoRA itself (model.adapter may ask for it too)."""
        return self.rank is not None

    def check_values(self) -> list[Problem]:
        return [
            *rule(
                self.rank is None or self.rank >= 1,
                "rank",
                "an adapter rank >= 1, or null for no LoRA",
                found_text(self.rank),
                "use e.g. `rank: 16`",
            ),
            *rule(
                self.alpha is None or 0 < self.alpha < float("inf"),
                "alpha",
                "a positive finite number, or null (= rank)",
                found_text(self.alpha),
                "use e.g. `alpha: 32` (twice the rank is common)",
            ),
            *rule(
                0 <= self.dropout < 1,
                "dropout",
                "a probability in [0, 1)",
                found_text(self.dropout),
                "use 0.0 (none) or e.g. 0.05",
            ),
            *rule(
                self.base_dtype is None or self.base_dtype in BASE_DTYPES,
                "base_dtype",
                "null (train.precision) or one of " + ", ".join(BASE_DTYPES),
                found_text(self.base_dtype),
                "use `base_dtype: int8` or `nf4`, or null",
            ),
            *rule(
                self.targets is None or (len(self.targets) > 0 and all(self.targets)),
                "targets",
                "a non-empty list of module names, or null (PEFT's default for the model)",
                found_text(None if self.targets is None else list(self.targets)),
                "use e.g. `targets: [q_proj, v_proj]`",
            ),
        ]
