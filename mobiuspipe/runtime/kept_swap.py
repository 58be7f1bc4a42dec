"""Swapping a keep or selective stage's held tensors (its kept graphs' saved tensors, its recomputed parts'
inputs) to a tier between F and B.

What moves is, per storage, the byte span its held tensors cover (aligned down to ALIGN bytes); in the
backward each tensor is rebuilt on the span that came back with its own dtype, offset, shape and strides. So
the backward computes on the same values in the same layouts and alignments (bit for bit), views that shared a
storage share one again, and a storage moves once however many saved tensors view it. Tensors in the stage's
buffers stay on the device (they live on; a copy would only add bytes), as do tensors without elements or in a
layout other than strided; tensors in host memory stay where they are (CUDA's memory-efficient attention keeps its
philox seed and offset there, read on the host by its backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mobiuspipe.memory.ledger import DeviceLedger, byte_range
from mobiuspipe.runtime.activations import Held

__all__ = ["ALIGN", "Member", "Layout", "spans_out", "release", "rebuild"]

ALIGN = 256
"""A span starts at a multiple of ALIGN bytes of its storage, so each rebuilt tensor keeps its address modulo
the allocator's alignment (64 bytes on the CPU, 512 for CUDA's caching allocator, of which ALIGN is the part
kernels look at): a kernel that picks its path by alignment picks the same one."""


@dataclass(frozen=True)
class Member:
    """A swapped Held: its span (index), byte offset in the span, dtype, shape and strides."""

    held: Held
    span: int
    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """How a kept forward's swapped tensors are rebuilt from the spans that come back, in span order."""

    members: tuple[Member, ...]
    num_spans: int


def spans_out(
    held: list[Held], stays: set[int], on_device: Callable[[torch.Tensor], bool]
) -> tuple[list[torch.Tensor], Layout]:
    """The uint8 spans (views of the held tensors' storages) to swap out, and their Layout. stays: the data
    pointers of storages that stay on the device (the stage's buffers); on_device: whether a tensor lies in the
    gpu's memory (Device.in_memory: the others are host tensors, which stay)."""
    groups: dict[int, list[Held]] = {}
    for h in held:
        t = h.t
        if t is None or t.numel() == 0 or t.layout != torch.strided or not on_device(t):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in stays:
            groups.setdefault(ptr, []).append(h)
    spans: list[torch.Tensor] = []
    members: list[Member] = []
    for group in groups.values():
        ranges = [_bytes(h.t) for h in group]
        start = min(a for a, _ in ranges) // ALIGN * ALIGN
        end = max(b for _, b in ranges)
        storage = group[0].t.untyped_storage()  # type: ignore[union-attr]
        device = group[0].t.device  # type: ignore[union-attr]
        spans.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (end - start,), (1,)))
        for h, (a, _) in zip(group, ranges):
            t = h.t
            assert t is not None
            members.append(Member(h, len(spans) - 1, a - start, t.dtype, tuple(t.shape), tuple(t.stride())))
    return spans, Layout(tuple(members), len(spans))


def release(layout: Layout, ledger: DeviceLedger) -> None:
    """The spans are on the tier: the device tensors go (the graph keeps only the Helds, now empty)."""
    for m in layout.members:
        if ledger.holds(m.held.key):
            ledger.drop(m.held.key)
        m.held.t = None


def rebuild(layout: Layout, spans: list[torch.Tensor]) -> None:
    """Each swapped Held again, as a view of the span that came back (fresh, contiguous uint8 tensors)."""
    if len(spans) != layout.num_spans:
        raise RuntimeError(f"{len(spans)} spans came back from the swap tier; {layout.num_spans} went out")
    for m in layout.members:
        span = spans[m.span]
        elem = m.dtype.itemsize
        first = span.storage_offset() + m.offset  # bytes from the start of the span's storage
        t = torch.empty(0, dtype=m.dtype, device=span.device)
        m.held.t = t.set_(span.untyped_storage(), first // elem, m.size, m.stride)


def _bytes(t: torch.Tensor | None) -> tuple[int, int]:
    """The byte range [start, end) t's elements span in its storage."""
    span = byte_range(t) if t is not None else None
    assert span is not None
    return span[1], span[2]
