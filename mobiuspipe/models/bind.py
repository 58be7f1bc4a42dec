"""The tensors a stage points its layers' parameters and buffers at (bind), once per visit, instead of
torch.func.functional_call around every call: the layers live on the meta device and run on the arena's views."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["Member", "members", "bind", "unbind"]


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
