"""A linear layer with a LoRA adapter beside it (LoraLinear: y = base(x) + B(A(dropout(x))) * scaling, as PEFT
computes it), and add_adapters, which wraps a module's target linear layers and freezes everything else.

The base is nn.Linear, or transformers' Conv1D (GPT-2, whose weight is stored [in, out]); A is [r, in], B is
[out, r] either way, as PEFT stores them. A new adapter starts as PEFT's does: A kaiming-uniform, B zero, so the
first step moves B only and the model starts as the base model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from mobiuspipe.lora.spec import LoraSpec, matches

__all__ = ["LoraLinear", "add_adapters", "with_adapters", "adapter_parameters", "linear_names", "BASE", "A", "B"]

BASE, A, B = "base_layer", "lora_A", "lora_B"
"""The attribute names of a LoraLinear's parts, as PEFT names them (its saved keys drop the adapter name)."""


def _features(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of nn.Linear or Conv1D (weight [in, out], out = nf)."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    weight = base.get_parameter("weight")
    return int(weight.shape[0]), int(weight.shape[1])


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


class LoraLinear(nn.Module):
    """`base` frozen, with a rank-r adapter beside it."""

    def __init__(self, base: nn.Module, spec: LoraSpec, generator: torch.Generator | None = None):
        super().__init__()
        fan_in, fan_out = _features(base)
        device = base.get_parameter("weight").device
        setattr(self, BASE, base)
        setattr(self, A, nn.Linear(fan_in, spec.rank, bias=False, device=device))
        setattr(self, B, nn.Linear(spec.rank, fan_out, bias=False, device=device))
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        for p in base.parameters():
            p.requires_grad_(False)
        if device.type != "meta":
            self.reset_adapter(generator)

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A new adapter: A kaiming-uniform (PEFT's default, a = sqrt(5)), B zero."""
        a, b = getattr(self, A).weight, getattr(self, B).weight
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_ with a = sqrt(5): gain sqrt(2 / 6) * sqrt(3 / fan_in)
        with torch.no_grad():
            a.uniform_(-bound, bound, generator=generator)
            b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = getattr(self, BASE)(x)
        a, b = getattr(self, A), getattr(self, B)
        return out + b(a(self.dropout(x.to(a.weight.dtype)))).to(out.dtype) * self.scaling


def linear_names(module: nn.Module) -> list[str]:
    """The dotted names of a module's linear layers (nn.Linear and Conv1D): what targets may name."""
    return [name for name, m in module.named_modules() if _is_linear(m) and name]


def add_adapters(module: nn.Module, spec: LoraSpec, generator: torch.Generator | None = None) -> list[str]:
    """Replace every target linear layer of `module` by a LoraLinear around it and freeze every other parameter;
    returns the names wrapped (none when the module has no target: an embedding, a norm)."""
    for p in module.parameters():
        p.requires_grad_(False)
    wrapped = [name for name in linear_names(module) if matches(name, spec.targets)]
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, LoraLinear(getattr(parent, child), spec, generator))
    return wrapped


def adapter_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters of a module, by name (what trains)."""
    return {name: p for name, p in module.named_parameters() if f".{A}." in f".{name}" or f".{B}." in f".{name}"}


def with_adapters(makers: Sequence[Callable[[], nn.Module]], spec: LoraSpec) -> list[Callable[[], nn.Module]]:
    """Layer factories whose layers come with adapters (add_adapters), each new adapter drawn from the seed torch
    has now and its layer's index: every rank draws the same for the layers it builds."""
    seed = torch.initial_seed()
    return [partial(_adapted, make, spec, seed, l) for l, make in enumerate(makers)]


def _adapted(make: Callable[[], nn.Module], spec: LoraSpec, seed: int, l: int) -> nn.Module:
    layer = make()
    if isinstance(layer, nn.Module):  # anything else is refused by the caller, naming the layer
        add_adapters(layer, spec, torch.Generator().manual_seed((seed * 1_000_003 + l) % 2**63))
    return layer
