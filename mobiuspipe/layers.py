"""The layers a Pipeline is given: modules, or factories that build them on the ranks that need them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from torch import nn

from mobiuspipe.errors import PipelineError

__all__ = ["LayerSpec", "factories", "build"]

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
