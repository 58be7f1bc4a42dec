"""Where a stand-in tensor's bytes are meant to live: a gpu's memory or pinned host memory (MOBIUSPIPE_STRICT=1).

On the CPU stand-in every tensor is a CPU tensor, so `host.add_(on_gpu)` runs where CUDA raises "Expected all
tensors to be on the same device". Under strict mode the stand-in marks the tensors it places: the device arena,
the stages' buffers and received messages as gpu g's (a subclass per gpu), the host tier's (pinned) buffers as
the host's. An op that takes marked tensors of two places fails, except the copies (copy_, item assignment), as
CUDA's do; so does an op on a marked tensor that names a device (.to(device), .cpu()): on the stand-in it cannot
tell the host from a gpu, so the code says which copy it means (Device.to_device, Device.to_host). Tensors no
one marked (a batch from the data, what autograd computes) meet either, and so does a 0-d host tensor except in a
join (stack, cat: CUDA lets a host scalar into an elementwise op, not into those); results keep the place.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._tensor import _convert

from mobiuspipe.standin import StandInError, strict

__all__ = ["Placed", "on_gpu", "on_host", "plain", "place_of", "host_buffer", "gpu_buffer", "gpu_of", "is_host"]


class Placed(torch.Tensor):
    """A CPU tensor that plays memory of one place; subclasses name the place."""

    place = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            _check(func, args, kwargs)
            out = func(*args, **kwargs)
        if func in _COPIES or func in _KEEP:
            return out  # the destination itself, or what the op gives as it is
        return _convert(out, cls)

    def __reduce_ex__(self, proto):
        return plain(self).__reduce_ex__(proto)  # saved and pickled as a plain tensor


def _check(func, args: tuple, kwargs: dict) -> None:
    """Raise StandInError if func(*args, **kwargs) is an op CUDA would refuse (module docstring)."""
    if func in _COPIES:
        return
    if func in _MOVES and _names_device(func, args, kwargs):
        raise StandInError(
            f"{_name(func)} names a device on a tensor in {_place(args)}: on the CPU stand-in that cannot tell the "
            f"host from a gpu; use Device.to_device or Device.to_host (or copy_ into a tensor of the place you mean)"
        )
    joins = func in _JOINS  # CUDA lets a 0-d host tensor into an elementwise op, not into a join
    places = {p for t in _leaves(args, kwargs) if (p := _marked(t, joins)) is not None}
    if len(places) > 1:
        raise StandInError(
            f"{_name(func)} mixes tensors in {' and '.join(sorted(places))}: CUDA refuses an op across devices; "
            f"copy one side first (copy_ into a tensor of the other place, Device.to_device, Device.to_host)"
        )


class OnHost(Placed):
    """Pinned host memory (the host tier, staging buffers)."""

    place = "host memory"


@functools.cache
def _gpu_class(index: int) -> type[Placed]:
    return type(f"OnGpu{index}", (Placed,), {"place": f"gpu {index}'s memory", "gpu": index, "__module__": __name__})


def on_gpu(t: torch.Tensor, index: int) -> torch.Tensor:
    """t (same memory) marked as gpu index's."""
    return _as(t, _gpu_class(index))


def on_host(t: torch.Tensor) -> torch.Tensor:
    """t (same memory) marked as (pinned) host memory."""
    return _as(t, OnHost)


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """t marked as host memory under strict mode on the CPU (a staging or tier buffer), else t itself."""
    return on_host(t) if strict() and not torch.cuda.is_available() else t


def gpu_buffer(t: torch.Tensor, index: int) -> torch.Tensor:
    """t marked as gpu index's memory under strict mode on the CPU (a peer's region), else t itself."""
    return on_gpu(t, index) if strict() and not torch.cuda.is_available() else t


def gpu_of(t: torch.Tensor) -> int | None:
    """The gpu whose memory t is marked as, None if it is not marked as a gpu's."""
    return getattr(type(t), "gpu", None)


def is_host(t: torch.Tensor) -> bool:
    """Whether t is marked as host memory."""
    return isinstance(t, OnHost)


def plain(t: torch.Tensor) -> torch.Tensor:
    """t (same memory) with no mark."""
    return _as(t, torch.Tensor)


def place_of(t: torch.Tensor) -> str | None:
    """The place t is marked with, None if unmarked."""
    return t.place if isinstance(t, Placed) else None


def _as(t: torch.Tensor, cls: type) -> torch.Tensor:
    if type(t) is cls:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(cls)


_COPIES = {torch.Tensor.copy_, torch.Tensor.__setitem__}
"""The ops that may take tensors of two places (CUDA's copies)."""

_KEEP = {torch.Tensor.__repr__, torch.Tensor.__format__}
"""Ops whose result is not a tensor of the input's place."""

_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}

_JOINS = {torch.stack, torch.cat}
"""Ops whose tensors must all be on one device, 0-d ones too."""


def _names_device(func, args: tuple, kwargs: dict) -> bool:
    if func is not torch.Tensor.to:
        return True
    named = [*args[1:], kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(a, (torch.device, str, torch.Tensor, int)) and not isinstance(a, bool) for a in named)


def _marked(t: Any, join: bool = False) -> str | None:
    """t's place, if it is marked and must be on the op's device (a 0-d host tensor need not, but in a join)."""
    if not isinstance(t, Placed) or (t.dim() == 0 and isinstance(t, OnHost) and not join):
        return None
    return t.place


def _leaves(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _place(args: tuple) -> str:
    return args[0].place if args and isinstance(args[0], Placed) else "a marked place"


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
