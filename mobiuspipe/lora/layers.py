"""A linear layer with a LoRA adapter beside it (LoraLinear: y = base(x) + B(A(dropout(x))) * scaling, as PEFT
computes it), and add_adapters, which wraps a module's target linear layers and freezes everything else.

The base is nn.Linear, or transformers' Conv1D (GPT-2, whose weight is stored [in, out]); A is [r, in], B is
[out, r] either way, as PEFT stores them. A new adapter starts as PEFT's does: A kaiming-uniform, B zero, so the
first step moves B only and the model starts as the base model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch import nn

from mobiuspipe.errors import PipelineError
from mobiuspipe.lora.spec import LoraSpec, matches

__all__ = [
    "LoraLinear",
    "Start",
    "add_adapters",
    "with_adapters",
    "load_adapter_tensors",
    "merge_adapters",
    "adapter_parameters",
    "linear_names",
    "is_linear",
    "BASE",
    "A",
    "B",
]

BASE, A, B = "base_layer", "lora_A", "lora_B"
"""The attribute names of a LoraLinear's parts, as PEFT names them (its saved keys drop the adapter name)."""


def _features(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of nn.Linear or Conv1D (weight [in, out], out = nf)."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    weight = base.get_parameter("weight")
    return int(weight.shape[0]), int(weight.shape[1])


def is_linear(m: nn.Module) -> bool:
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


def merge_adapters(module: nn.Module) -> None:
    """Put each LoraLinear's base back in its place, its weight plus the adapter's update (scaling * B A, [out, in];
    transposed for Conv1D's [in, out] weight), as PEFT's merge_and_unload does: the module then computes what it
    computed with the adapters, under its own names."""
    for name, m in list(module.named_modules()):
        if not isinstance(m, LoraLinear):
            continue
        base = getattr(m, BASE)
        weight = base.get_parameter("weight")
        delta = (getattr(m, B).weight @ getattr(m, A).weight) * m.scaling
        with torch.no_grad():
            weight += (delta if isinstance(base, nn.Linear) else delta.T).to(weight.dtype)
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, base)


def linear_names(module: nn.Module) -> list[str]:
    """The dotted names of a module's linear layers (nn.Linear and Conv1D): what targets may name."""
    return [name for name, m in module.named_modules() if is_linear(m) and name]


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


Start = Mapping[int, Mapping[str, torch.Tensor]]
"""A saved adapter to continue: layer index -> adapter parameter name in the layer -> its tensor."""


def with_adapters(
    makers: Sequence[Callable[[], nn.Module]], spec: LoraSpec, start: Start | None = None
) -> list[Callable[[], nn.Module]]:
    """Layer factories whose layers come with adapters (add_adapters): `start`'s tensors, or new ones, each drawn
    from the seed torch has now and its layer's index: every rank draws the same for the layers it builds."""
    seed = torch.initial_seed()
    return [partial(_adapted, make, spec, seed, l, start) for l, make in enumerate(makers)]


ADAPTED = "_mobiuspipe_adapted"
"""The attribute _adapted sets on a layer it gave adapters."""


def _adapted(make: Callable[[], nn.Module], spec: LoraSpec, seed: int, l: int, start: Start | None) -> nn.Module:
    layer = make()
    if not isinstance(layer, nn.Module):  # refused by the caller, naming the layer
        return layer
    if getattr(layer, ADAPTED, False):  # a layer given as a module, made again (rank 0 profiles it, then trains it)
        return layer
    add_adapters(layer, spec, torch.Generator().manual_seed((seed * 1_000_003 + l) % 2**63))
    if start is not None:
        load_adapter_tensors(layer, start.get(l, {}), l)
    setattr(layer, ADAPTED, True)
    return layer


def load_adapter_tensors(layer: nn.Module, tensors: Mapping[str, torch.Tensor], l: int) -> None:
    """Copy a saved adapter's tensors of layer l into its adapters; PipelineError naming what is missing, extra or
    of another shape (an adapter saved for other targets or another model)."""
    params = adapter_parameters(layer)
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    shapes = [
        f"{n} {tuple(tensors[n].shape)} for {tuple(p.shape)}"
        for n, p in params.items()
        if n in tensors and tensors[n].shape != p.shape
    ]
    if missing or extra or shapes:
        found = "; ".join(
            part
            for part in (
                f"no tensor for {', '.join(missing)}" if missing else "",
                f"tensors for no adapter here: {', '.join(extra)}" if extra else "",
                f"other shapes: {', '.join(shapes)}" if shapes else "",
            )
            if part
        )
        raise PipelineError(
            f"layer {l}: expected the saved adapter to hold this layer's adapters, found {found}: continue an "
            f"adapter saved for this model with the same rank and targets, or start a new one"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
