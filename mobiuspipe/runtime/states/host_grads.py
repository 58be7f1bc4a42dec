"""A stage's offloaded gradients in host memory (HostGrads): the copies off the device into them, and their finishing
on the host (an accumulated pass's add, clipping's squared norm, fp16's finiteness) off the compute thread, or the
checks reduced on the gpu where the host receives the slot's gradients as they are (a step's only pass)."""

from __future__ import annotations

import math
from concurrent.futures import Future
from functools import partial

import torch

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.reduce import all_finite, finite_flag, squared_norm, sum_of_squares

__all__ = ["HostGrads"]


class HostGrads:
    """`versions` gradient buffers of the device dtype in host memory (pinned on CUDA; two with the delayed update,
    whose update n reads one while step n + 1's offload fills the other). take() starts a copy off the device on the
    copy-out stream; once it has ended, Device.after_copy's thread finishes it: adds an accumulated pass to the
    buffer and notes what the step asked for. On CUDA the compute thread issues the copy and runs on; finishing it
    there would wait for the copy and then read the whole buffer while the gpu waits. Whoever reads a buffer settles
    it first (settle). A take that adds nothing (a step's only pass) has the norm and the finiteness reduced from
    the slot on the gpu instead, before the copy: no pass over host memory, and nothing that waits for the copy (the
    step's last, the first stage's, ends after the backward): sumsq and all_finite give them as gpu tensors, for
    the engine to read with the other stages' at once."""

    def __init__(self, numel: int, dtype: torch.dtype, pin, versions: int = 1):
        """pin: page-locks a host tensor (Device.pin)."""
        self._pin = pin
        self._buffers = [pin(torch.zeros(numel, dtype=dtype)) for _ in range(versions)]
        self._incoming: torch.Tensor | None = None
        self._taken = 0
        """The buffer take() filled last (what the norm, the overflow check and a tied exchange read)."""
        self._finishing: tuple[Future, int] | None = None
        """The last take()'s finishing (Device.after_copy's future) and the buffer it fills."""
        self._sumsq: float | torch.Tensor | None = None
        """The squared L2 norm (float64) of the buffer take() filled last, when it was asked for it (a 0-d tensor on
        the gpu when reduced there)."""
        self._finite: bool | torch.Tensor | None = None
        """Whether that buffer was all finite as taken, when it was asked for it (a 0-d tensor on the gpu when reduced
        there)."""
        self._adds_finite = True
        """Whether every tied half added into that buffer since (add) left it finite."""

    def buffer(self, i: int) -> torch.Tensor:
        """Gradient buffer i (settle(i) before reading it)."""
        return self._buffers[i]

    @property
    def last(self) -> torch.Tensor:
        """The buffer take() filled last."""
        return self._buffers[self._taken]

    def take(
        self,
        src: torch.Tensor,
        device: Device,
        accumulate: bool = False,
        norm: bool = False,
        finite: bool = False,
        into: int = 0,
    ) -> CopyHandle:
        """Start copying src (the stage's flat gradients on the device) into buffer `into`, or (accumulate) into a
        buffer whose contents are then added to it; with norm, note the result's squared L2 norm, with finite
        whether it is all finite (reduced from src on the gpu unless accumulating). Nothing here waits but for the
        previous take's finishing, which reads the buffer an accumulated pass comes into (it began a pass ago).
        Returns the copy: src's slot is free after it."""
        self.settle()
        self._sumsq, self._finite, self._adds_finite = None, None, True
        if not accumulate:  # the buffer gets src as it is: its checks are src's, reduced on the gpu
            self._sumsq = squared_norm(src) if norm else None
            if finite:
                self._finite = finite_flag(src) if self._sumsq is None else torch.isfinite(self._sumsq)
            norm = finite = False
        dst = self._incoming_buffer() if accumulate else self._buffers[into]
        copy = device.copy_out(dst, src)
        finished = device.after_copy(copy, partial(self._finish, accumulate, norm, finite, into))
        self._finishing, self._taken = (finished, into), into
        return copy

    def _finish(self, accumulate: bool, norm: bool, finite: bool, into: int) -> None:
        """On Device.after_copy's thread, once the copy has ended: the add, and the norm and the finiteness when they
        are left to it (an accumulated pass's). A float64 sum of squares of finite floats of any torch dtype is
        finite, so with the norm it tells the finiteness too."""
        grads = self._buffers[into]
        if accumulate:
            grads.add_(self._incoming_buffer())
        sumsq = sum_of_squares(grads) if norm else None
        if norm:
            self._sumsq = sumsq
        if finite:
            self._finite = math.isfinite(sumsq) if sumsq is not None else all_finite(grads)

    def settle(self, only: int | None = None) -> None:
        """Wait for the last take()'s finishing (only: if it fills buffer `only`), raising its error."""
        finishing = self._finishing
        if finishing is not None and only in (None, finishing[1]):
            finishing[0].result()

    def make_accumulation_buffer(self) -> None:
        """Make the buffer an accumulated pass's gradients come into now (on CUDA page-locked: not mid-step)."""
        self._incoming_buffer()

    def _incoming_buffer(self) -> torch.Tensor:
        """A host buffer like the gradients, for an accumulated pass on its way."""
        incoming = self._incoming
        if incoming is None:
            incoming = self._incoming = self._pin(torch.empty_like(self._buffers[0]))
        return incoming

    def sumsq(self) -> float | torch.Tensor:
        """The squared L2 norm of the last offloaded gradients (0.0 when take() was not asked for it; a 0-d tensor
        on the gpu, not waiting for the copy, when reduced there)."""
        if not isinstance(self._sumsq, torch.Tensor):
            self.settle()
        return 0.0 if self._sumsq is None else self._sumsq

    def all_finite(self) -> bool | torch.Tensor:
        """Whether the last offloaded gradients hold no inf or nan (read here when take() was not asked for it; a 0-d
        tensor on the gpu, not waiting for the copy, when reduced there)."""
        if not self._adds_finite:
            return False
        if isinstance(self._finite, torch.Tensor):
            return self._finite
        self.settle()
        return all_finite(self.last) if self._finite is None else self._finite

    def read(self, offset: int, n: int) -> torch.Tensor:
        """A copy of elements offset .. offset + n of the last offloaded gradients."""
        self.settle()
        return self.last[offset : offset + n].clone()

    def add(self, offset: int, t: torch.Tensor) -> None:
        """Add t into the last offloaded gradients from element offset on (a tied parameter's other half); the
        finiteness noted covers the sums (two finite fp16 halves may add up to an inf)."""
        self.settle()
        part = self.last[offset : offset + t.numel()]
        part.add_(t)
        if self._finite is not None and self._adds_finite:
            self._adds_finite = all_finite(part)
