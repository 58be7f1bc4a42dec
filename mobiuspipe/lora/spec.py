"""What a LoRA adapter is: its rank r, alpha (the update is scaled by alpha / r, or alpha / sqrt(r) with rsLoRA),
dropout on the adapter's input, and the target modules, named as PEFT's `target_modules` (a linear layer whose
name is a target or ends with "." and a target)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from partition.spec.lora import BASE_DTYPES

__all__ = ["LoraSpec", "matches", "BASE_DTYPES"]


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape and scale (PEFT's LoraConfig fields r, lora_alpha, lora_dropout, target_modules,
    use_rslora)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    """Sorted, each once (PEFT keeps them as a set)."""
    dropout: float = 0.0
    rslora: bool = False
    base_dtype: str | None = None
    """How the frozen base is kept and streamed: None = the training dtype; "int8" = a byte per weight and a scale
    per output feature; "nf4" = QLoRA's 4-bit NormalFloat (mobiuspipe.lora.quant). Not part of a PEFT adapter: a
    training choice."""

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"LoRA rank: expected an integer >= 1, found {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha: expected a number > 0, found {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout: expected a probability in [0, 1), found {self.dropout!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoRA targets: expected module names such as q_proj or c_attn, found {self.targets!r}")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LoRA base_dtype: expected None (the training dtype) or one of {', '.join(BASE_DTYPES)}, found "
                f"{self.base_dtype!r}"
            )
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))

    @property
    def scaling(self) -> float:
        """What the adapter's output is multiplied by: alpha / r (rsLoRA: alpha / sqrt(r))."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def matches(name: str, targets: tuple[str, ...]) -> bool:
    """Whether module `name` (dotted) is a target, by PEFT's rule for a list of names."""
    return any(name == t or name.endswith(f".{t}") for t in targets)
