"""The device-bytes ledger: which tensors a rank holds on its device, counted once per byte of storage.

The engine holds a tensor under a key, a tuple whose first item is its kind ("arena", "inbox", "saved",
...), and drops the key when it lets the tensor go. The ledger keeps no reference to the tensor (it must not
change what lives); it keeps the byte range the tensor spans in its storage. Bytes count once per storage:
two views of one buffer count the union of their ranges, the same tensor held under two keys counts once,
so `bytes` is what the device really holds among the tensors the engine told it about. `peak_bytes` is the
most held at once since reset_peak(); `peak_parts` is, at that moment, the bytes held under each kind (a
byte held under two kinds is credited to one of them, KIND_ORDER, so the parts add up to the peak).
"""

from __future__ import annotations

import torch

__all__ = ["DeviceLedger", "KIND_ORDER", "byte_range"]

StorageKey = tuple[torch.device, int]
"""(device, data pointer) of a storage."""
Span = tuple[StorageKey, int, int]
"""A held tensor's storage and the byte range [start, end) it spans there."""


def byte_range(t: torch.Tensor) -> Span | None:
    """The storage of t and the bytes [start, end) its elements span in it (strides honoured: an expanded
    tensor spans its real memory); None for a tensor without elements."""
    if t.numel() == 0:
        return None
    if t.layout != torch.strided:  # sparse and other layouts: their own bytes, as if in a storage of their own
        return (t.device, id(t)), 0, t.numel() * t.element_size()
    size = t.element_size()
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        span = t.numel()
    else:
        span = 1 + sum((int(n) - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = int(t.storage_offset()) * size
    return (t.device, t.data_ptr() - start), start, start + span * size  # data_ptr() - start: the storage's


def _union(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of [start, end) ranges."""
    total, reach = 0, None
    for a, b in sorted(ranges):
        if reach is None or a >= reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


class _Tally:
    """Held ranges per storage and the bytes of their union, kept up to date one storage at a time."""

    def __init__(self) -> None:
        self.ranges: dict[StorageKey, list[tuple[int, int]]] = {}
        self.covered: dict[StorageKey, int] = {}
        self.bytes = 0

    def add(self, storage: StorageKey, a: int, b: int) -> None:
        self.ranges.setdefault(storage, []).append((a, b))
        self._recount(storage)

    def remove(self, storage: StorageKey, a: int, b: int) -> None:
        self.ranges[storage].remove((a, b))
        self._recount(storage)

    def _recount(self, storage: StorageKey) -> None:
        ranges = self.ranges[storage]
        now = ranges[0][1] - ranges[0][0] if len(ranges) == 1 else _union(ranges)
        self.bytes += now - self.covered.get(storage, 0)
        if ranges:
            self.covered[storage] = now
        else:
            del self.ranges[storage], self.covered[storage]


KIND_ORDER = (
    "arena",
    "buffers",
    "states",
    "sending",
    "inbox",
    "outbox",
    "saved",
    "kept",
    "swapin",
    "inputs",
    "output",
    "autograd",
)
"""Who a byte held under several kinds is credited to in parts(): the first of its kinds in this order
(other kinds after these, by name). Autograd saves views of the arena's weights and of the stage input: they
count as arena and inputs, and "autograd" is what backward alone keeps alive; "kept" is what a keep or selective
stage holds from its forward to its backward (graphs and segment inputs) beyond the kinds before it; "states" the
gpu tier's resident optimizer states (memory.optimizer device)."""


class DeviceLedger:
    """Bytes held on one device, by storage; the peak since reset_peak() and what made it up."""

    def __init__(self) -> None:
        self._held: dict[tuple, Span | None] = {}
        self._all = _Tally()
        self.peak_bytes = 0
        self._at_peak: dict[tuple, Span | None] = {}
        self._peak_pending = False
        """A new peak was reached and not yet copied: _held is still what it was then (only holds, each one a
        new peak, have come since), so it is copied before the next drop, at a hold that adds no bytes, or when
        peak_parts asks. One copy per peak instead of one per hold: a kept forward holds hundreds of tensors in
        a row, each a new peak."""

    @property
    def bytes(self) -> int:
        """Bytes held now (each storage byte once)."""
        return self._all.bytes

    def hold(self, key: tuple, t: torch.Tensor) -> None:
        """Count t under key (a tuple, its first item the kind); a key already held is replaced."""
        if key in self._held:
            self.drop(key)
        span = byte_range(t)
        self._held[key] = span
        if span is None:
            return
        self._all.add(*span)
        if self._all.bytes > self.peak_bytes:
            self.peak_bytes = self._all.bytes
            self._peak_pending = True
        elif self._peak_pending:  # held grew without a new peak (bytes already counted): the peak was before it
            self._at_peak = {k: v for k, v in self._held.items() if k != key}
            self._peak_pending = False

    def drop(self, key: tuple) -> None:
        """Stop counting what key holds; KeyError if it holds nothing (an accounting bug)."""
        if self._peak_pending:
            self._copy_peak()
        span = self._held.pop(key)
        if span is not None:
            self._all.remove(*span)

    def drop_kind(self, kind: str) -> None:
        """Drop every key of this kind."""
        for key in self.keys(kind):
            self.drop(key)

    def holds(self, key: tuple) -> bool:
        return key in self._held

    def keys(self, kind: str) -> list[tuple]:
        """The keys of this kind held now."""
        return [k for k in self._held if k[0] == kind]

    def parts(self) -> dict[str, int]:
        """Bytes held now by kind; each byte credited once (KIND_ORDER), so the parts add up to `bytes`."""
        return _parts(self._held)

    @property
    def peak_parts(self) -> dict[str, int]:
        """parts() at the moment of the peak."""
        if self._peak_pending:
            self._copy_peak()
        return _parts(self._at_peak)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (call at the start of a step)."""
        self.peak_bytes = self._all.bytes
        self._copy_peak()

    def _copy_peak(self) -> None:
        self._at_peak = dict(self._held)  # a shallow copy: parts are worked out only when asked for
        self._peak_pending = False


def _parts(held: dict[tuple, Span | None]) -> dict[str, int]:
    """Bytes by kind, each storage byte credited to the first of its kinds in KIND_ORDER (kinds with none left out)."""
    kinds = sorted(
        {str(k[0]) for k in held}, key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k)
    )
    covered: dict[StorageKey, list[tuple[int, int]]] = {}
    out = {}
    for kind in kinds:
        gained = 0
        for key, span in held.items():
            if span is None or key[0] != kind:
                continue
            storage, a, b = span
            ranges = covered.setdefault(storage, [])
            before = _union(ranges)
            ranges.append((a, b))
            gained += _union(ranges) - before
        if gained:
            out[kind] = gained
    return out
