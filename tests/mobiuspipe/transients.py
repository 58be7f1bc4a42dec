"""X_l measured on the CPU as a gpu's allocator would see it: the most bytes of new tensors alive at once while a
layer's backward (and its forward) runs (every op's outputs tracked through a dispatch mode until freed), beyond what
the forward left alive. Not seen: what a kernel allocates inside itself (flash attention's fp32 accumulator, CUDA's
sorted embedding gradient), an `out=` tensor resized from nothing, and the CPU's own kernels where a gpu's differ
(attention's dropout): a GPU's profile measures those."""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Live(TorchDispatchMode):
    """Bytes of the storages ops made and not yet freed, and their most since `mark`."""

    def __init__(self):
        super().__init__()
        self.live, self.top, self.base = 0, 0, 0
        self._keys: set[int] = set()

    def mark(self) -> None:
        self.top = self.base = self.live

    def _made(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        self._keys.add(key)
        self.live += storage.nbytes()
        self.top = max(self.top, self.live)
        weakref.finalize(storage, self._freed, key, storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._keys.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.nbytes() and s.data_ptr() not in given and s.data_ptr() not in self._keys:  # in place: not new
                    self._made(s)
        return out


def measured_transients(layer: nn.Module, x: torch.Tensor, loss_fn=None, forward: bool = False) -> int:
    """X_l of `layer` on input x: its forward with grad (and `loss_fn` on its output), then its backward with
    a fixed gradient (the loss's for the last layer), the trainable weights' gradients already allocated (the
    runtime's gradient slot) so each weight's new gradient counts until added in; the most bytes alive at once over
    the backward, with `forward` over the forward too, beyond what the forward left alive (the profiler's CUDA figure,
    forward included: the allocator's peak over a recompute and its backward, less what was allocated once the
    recompute ended)."""
    x = x.detach().requires_grad_(x.is_floating_point())
    for p in layer.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    with _Live() as live:
        y = layer(x)
        y = loss_fn(y) if loss_fn is not None else y
        grad = None if loss_fn is not None else torch.randn_like(y)
        forward_top = live.top  # the forward's own transients, which the allocator's peak sees too
        live.mark()
        y.backward(grad)
        del y, grad
    for p in layer.parameters():
        p.grad = None
    return max(forward_top if forward else 0, live.top) - live.base


@contextlib.contextmanager
def bool_mask_dropout():
    """F.dropout as CUDA runs it (torch.native_dropout: a bool mask kept, one byte an element) instead of the CPU's,
    which keeps its noise in the activations' dtype: a gpu's dropout backward has less of its own to free."""
    plain = F.dropout

    def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = plain
