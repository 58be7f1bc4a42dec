"""The ledger copies what it holds once per peak, not at every hold: the same peak and parts as copying at every
new peak (the reference below), on random holds, drops and resets of views that share storages."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mobiuspipe.memory.ledger import DeviceLedger, _parts, byte_range


class EagerLedger(DeviceLedger):
    """The reference: the state at every new peak copied at once."""

    def hold(self, key: tuple, t: torch.Tensor) -> None:
        super().hold(key, t)
        if self._peak_pending:
            self._copy_peak()


BUFFERS = [torch.zeros(64), torch.zeros(32), torch.zeros(0)]
"""Three storages (one empty); the held tensors are slices of them, so ranges overlap and repeat."""
KINDS = ["arena", "inbox", "kept", "saved", "autograd"]

hold_op = st.tuples(
    st.just("hold"),
    st.sampled_from(KINDS),
    st.integers(0, 5),  # the key's number: a key held again is replaced
    st.integers(0, 2),  # which buffer
    st.integers(0, 63),
    st.integers(0, 40),
)
other_op = st.tuples(st.sampled_from(["drop", "reset"]), st.integers(0, 50))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.one_of(hold_op, hold_op, other_op), max_size=60))
def test_the_peak_and_its_parts_equal_copying_at_every_new_peak(ops):
    lazy, eager = DeviceLedger(), EagerLedger()
    for op in ops:
        if op[0] == "hold":
            _, kind, n, b, start, length = op
            buf = BUFFERS[b]
            t = buf[min(start, buf.numel()) : min(start + length, buf.numel())]
            for ledger in (lazy, eager):
                ledger.hold((kind, n), t)
        elif op[0] == "drop":
            held = sorted(lazy._held)
            if held:
                key = held[op[1] % len(held)]
                for ledger in (lazy, eager):
                    ledger.drop(key)
        else:
            for ledger in (lazy, eager):
                ledger.reset_peak()
        assert lazy.peak_bytes == eager.peak_bytes and lazy.bytes == eager.bytes
    assert lazy.peak_parts == eager.peak_parts
    assert sum(lazy.peak_parts.values()) == lazy.peak_bytes
    assert _parts(lazy._held) == lazy.parts()


def test_a_run_of_holds_copies_once():
    ledger, copies = DeviceLedger(), []
    real = ledger._copy_peak
    ledger._copy_peak = lambda: copies.append(1) or real()
    tensors = [torch.zeros(4) for _ in range(100)]  # alive: 100 storages of 16 bytes
    for i, t in enumerate(tensors):
        ledger.hold(("kept", i), t)
    assert copies == [] and ledger.peak_bytes == 1600
    ledger.drop(("kept", 0))
    assert copies == [1] and ledger.peak_parts == {"kept": 1600}


def test_byte_range_of_contiguous_and_strided_views():
    """The contiguous fast path spans what the strided rule gives: 1 + sum((n - 1) * |stride|) elements."""
    base = torch.zeros(6, 7, 5)
    views = [base, base[2:4], base[1, 3], base[:, :, 2], base.transpose(0, 2), base[..., 1:2], base[:1, 4:5, 3:4]]
    views += [torch.zeros(3, 1).expand(3, 4), base.view(-1)[7:8]]
    for v in views:
        span = byte_range(v)
        assert span is not None
        storage, start, end = span
        assert storage == (v.device, v.untyped_storage().data_ptr())
        strided = 1 + sum((n - 1) * abs(s) for n, s in zip(v.shape, v.stride()))
        assert (start, end) == (v.storage_offset() * 4, (v.storage_offset() + strided) * 4), (v.shape, v.stride())
    assert byte_range(base[:0]) is None
