"""The device arena: fixed slots, exact accounting, clear errors, slots independent for autograd."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.errors import ArenaError
from mobiuspipe.memory.arena import DeviceArena


def test_accounting_and_peak():
    a = DeviceArena(1000, 3, torch.device("cpu"))
    assert a.slot_bytes == 1024 and a.budget_bytes == 3072 and a.buffer.numel() == 3072
    s1, s2 = a.acquire(1000, "x"), a.acquire(7, "y")
    assert (a.in_use_bytes, a.peak_bytes) == (1007, 1007)
    a.release(s1)
    assert (a.in_use_bytes, a.peak_bytes) == (7, 1007)
    a.reset_peak()
    assert a.peak_bytes == 7
    a.release(s2)
    assert a.in_use_bytes == 0


def test_too_big_and_full_are_errors():
    a = DeviceArena(256, 2, torch.device("cpu"))
    with pytest.raises(ArenaError, match="stage 3 weights needs 257 bytes but an arena slot has 256"):
        a.acquire(257, "stage 3 weights")
    a.acquire(1, "a")
    a.acquire(1, "b")
    with pytest.raises(ArenaError, match="all 2 arena slots are in use"):
        a.acquire(1, "c")


def test_slots_share_the_buffer_but_not_autograd_versions():
    a = DeviceArena(256, 2, torch.device("cpu"))
    s1, s2 = a.acquire(64, "w"), a.acquire(64, "next")
    w = s1.view(torch.float32, 4).fill_(2.0).detach().requires_grad_(True)
    loss = (w * w).sum()  # saves w for backward
    s2.view(torch.float32, 16).copy_(torch.arange(16.0))  # a prefetch into the other slot
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full((4,), 4.0))
    assert torch.equal(a.buffer[256:320].view(torch.float32), torch.arange(16.0))


def test_acquire_takes_the_slot_freed_longest_ago():
    """A slot released just now may still be read by its offload: the next holder takes the one freed earlier."""
    arena = DeviceArena(64, 3, torch.device("cpu"))
    a, b, c = (arena.acquire(64, f"stage {j} weights") for j in range(3))
    assert [a.index, b.index, c.index] == [0, 1, 2]
    for s in (b, a, c):
        arena.release(s)
    assert [arena.acquire(64, "x").index for _ in range(3)] == [1, 0, 2]


def test_a_gradient_slot_of_its_own_size_takes_gradients_alone():
    """LoRA's arena: two weight slots of W and one smaller slot that only gradients take (after the weight slots
    in the buffer); without one, gradients take any slot as before."""
    arena = DeviceArena(1000, 2, torch.device("cpu"), grad_slot_bytes=100)
    assert (arena.slot_bytes, arena.grad_slot_bytes, arena.budget_bytes) == (1024, 256, 2 * 1024 + 256)
    w1, w2 = arena.acquire(1000, "stage 0 weights"), arena.acquire(1000, "stage 1 weights")
    with pytest.raises(ArenaError, match="all 3 arena slots are in use"):
        arena.acquire(8, "stage 2 weights")  # the gradient slot is free, but not for weights
    g = arena.acquire(100, "stage 0 gradients", grads=True)
    assert g.grads and g.index == 2 and g.data.data_ptr() == arena.buffer.data_ptr() + 2 * 1024
    assert g.data.numel() == 256 and arena.in_use_bytes == 2100
    with pytest.raises(ArenaError, match="stage 1 gradients needs 257 bytes but the gradient slot has 256"):
        arena.release(g)
        arena.acquire(257, "stage 1 gradients", grads=True)
    arena.release(w1)
    assert arena.acquire(1000, "stage 2 weights").index == w1.index and not w2.grads
    plain = DeviceArena(64, 3, torch.device("cpu"))
    assert plain.acquire(64, "stage 0 gradients", grads=True).index == 0  # no gradient slot: any slot


def test_every_slot_starts_on_a_256_byte_boundary_of_the_arena():
    """cuBLAS picks its kernels by its pointers' alignment (up to 256 bytes): a stage's tensors must lie at the same
    alignment whichever slot it takes, or a resumed run (its slots taken in another order) may round otherwise."""
    a = DeviceArena(1072, 3, torch.device("cpu"), grad_slot_bytes=200)
    slots = [a.acquire(1072, "w") for _ in range(3)] + [a.acquire(200, "g", grads=True)]
    assert all((s.data.data_ptr() - a.buffer.data_ptr()) % 256 == 0 for s in slots)
