"""The layers a Pipeline is given: modules, or factories that build them on the ranks that need them; and the tensors
a stage points their parameters and buffers at (bind), instead of torch.func.functional_call at every call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from mobiuspipe.errors import PipelineError

__all__ = ["LayerSpec", "factories", "build", "Member", "members", "bind", "unbind"]

LayerSpec = nn.Module | Callable[[], nn.Module]
"""A layer, or a factory that builds it."""


def factories(layers: nn.Sequential | Sequence[LayerSpec]) -> list[Callable[[], nn.Module]]:
    """Every layer as a factory (a module becomes a factory that returns it)."""
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential):
        raise PipelineError(
            f"layers is a single {type(layers).__name__}; expected an nn.Sequential or a list of "
            f"layers (or of factories that build them): the pipeline cuts between layers"
        )
    items = list(layers)
    if not items:
        raise PipelineError("layers is empty; expected at least one layer")
    out = []
    for l, item in enumerate(items):
        if isinstance(item, nn.Module):
            out.append(partial(_same, item))
        elif callable(item):
            out.append(item)
        else:
            raise PipelineError(
                f"layer {l} is a {type(item).__name__}; expected an nn.Module or a zero-argument "
                f"callable that returns one"
            )
    return out


def _same(module: nn.Module) -> nn.Module:
    return module


def build(make: Callable[[], nn.Module], l: int) -> nn.Module:
    layer = make()
    if not isinstance(layer, nn.Module):
        raise PipelineError(f"the factory of layer {l} returned a {type(layer).__name__}; expected an nn.Module")
    return layer


class Member(NamedTuple):
    """One parameter or buffer of a layer, where it lives: the module that holds it and its attribute there."""

    module: nn.Module
    attr: str
    param: bool
    """A parameter (else a buffer)."""
    key: str
    """Its name in the layer: the first of its names (named_parameters / named_buffers), under which a stage
    gives its tensor (a tied tensor gets the same one under each name, as functional_call ties them)."""
    original: torch.Tensor | None
    """What the module held before any bind (unbind puts it back)."""


def members(layer: nn.Module) -> list[Member]:
    """Every parameter and buffer of the layer, a tied one under each of its names."""
    out = []
    for param, named in ((True, layer.named_parameters), (False, layer.named_buffers)):
        first: dict[int, str] = {}
        for name, t in named(remove_duplicate=False):
            path, _, attr = name.rpartition(".")
            out.append(Member(layer.get_submodule(path), attr, param, first.setdefault(id(t), name), t))
    return out


def bind(found: list[Member], tensors: dict[str, torch.Tensor]) -> None:
    """Point each member at tensors[its key] (those missing keep theirs) until the next bind or unbind: what
    functional_call does around one call, done once for many."""
    for m in found:
        t = tensors.get(m.key)
        if t is not None:
            _slots(m)[m.attr] = t


def unbind(found: list[Member]) -> None:
    """Put back what each member held before bind."""
    for m in found:
        _slots(m)[m.attr] = m.original


def _slots(m: Member) -> dict[str, torch.Tensor | None]:
    """The module's dict the member lives in (a plain tensor where a Parameter was: as functional_call sets it)."""
    return m.module._parameters if m.param else m.module._buffers  # pyright: ignore[reportReturnType]
