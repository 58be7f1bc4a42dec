"""Where a stand-in tensor's bytes are meant to live: a gpu's memory or pinned host memory (MOBIUSPIPE_STRICT=1).

On the CPU stand-in every tensor is a CPU tensor, so `host.add_(on_gpu)` runs where CUDA raises "Expected all
tensors to be on the same device". Under strict mode the stand-in marks the tensors it places: the device arena,
the stages' buffers and received messages as gpu g's (a subclass per gpu), the host tier's (pinned) buffers as
the host's. An op that takes marked tensors of two places fails, except the copies (copy_, item assignment), as
CUDA's do; so does an op on a marked tensor that names a device (.to(device), .cpu()): on the stand-in it cannot
tell the host from a gpu, so the code says which copy it means (Device.to_device, Device.to_host). Tensors no
one marked (a batch from the data, what autograd computes) meet either, and so does a 0-d host tensor except in a
join (stack, cat: CUDA lets a host scalar into an elementwise op, not into those); results keep the place.
During a pass (in_pass, which Device.stepping enters on the compute thread) an op that reads a gpu's tensor on the
host (item, bool, tolist, nonzero, a boolean mask's indexing...) fails too: on CUDA the host would wait there for
the compute stream, where the runtime allows one wait a step, the losses' read after the pass.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._tensor import _convert

from mobiuspipe.standin import StandInError, strict

__all__ = [
    "Placed",
    "on_gpu",
    "on_host",
    "plain",
    "place_of",
    "host_buffer",
    "gpu_buffer",
    "gpu_of",
    "is_host",
    "in_pass",
    "read_waiting",
]


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
    if getattr(_pass, "on", False) and _reads_on_host(func, args):
        raise StandInError(
            f"{_name(func)} reads {_place(args)} on the host during a pass: on CUDA the host waits there for the "
            f"compute queued so far (one wait a step is the budget: the losses' read after the pass); keep the value "
            f"on the gpu, or read it after the pass"
        )
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

_READS = {
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.argwhere,
    torch.argwhere,
    torch.Tensor.unique,
    torch.unique,
    torch.Tensor.masked_select,
    torch.masked_select,
}
"""Ops that read a tensor's values on the host, or size their result by them (on CUDA a wait for the stream)."""

_pass = threading.local()
"""on: the calling thread runs a pass (in_pass)."""


@contextmanager
def in_pass() -> Iterator[None]:
    """The calling thread runs a pass of the schedule or an evaluation: a host read of a gpu's tensor fails in it."""
    before = getattr(_pass, "on", False)
    _pass.on = True
    try:
        yield
    finally:
        _pass.on = before


def read_waiting(t: torch.Tensor) -> list:
    """t's values as a list, read on the host where the caller means the wait for the stream it costs (a shape
    header, at a batch shape's first step): the pass rule lets this read through."""
    return plain(t).tolist()


def _reads_on_host(func, args: tuple) -> bool:
    """Whether func reads a gpu's tensor among args on the host (a boolean mask's indexing too)."""
    if func is torch.Tensor.__getitem__:
        index = args[1] if len(args) > 1 else None
        masks = index if isinstance(index, tuple) else (index,)
        if not any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks):
            return False
    elif func not in _READS:
        return False
    return any(gpu_of(t) is not None for t in _leaves(args, {}) if isinstance(t, torch.Tensor))


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
