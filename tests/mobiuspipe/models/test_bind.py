"""mobiuspipe.models.bind: a meta layer bound to tensors computes what torch.func.functional_call computes with them,
tied parameters and buffers included, and unbind gives the layer back its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from mobiuspipe.models.bind import bind, members, unbind


class Tied(nn.Module):
    """A linear used twice under two names (a tie), a bias-free linear, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = self.a
        self.c = nn.Linear(5, 3, bias=False)
        self.register_buffer("scale", torch.full((5,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(x))) * self.scale)


@pytest.mark.parametrize("seed", range(3))
def test_bound_meta_layer_equals_functional_call(seed):
    torch.manual_seed(seed)
    real = Tied()
    tensors = {n: torch.randn_like(p) for n, p in real.named_parameters()} | dict(real.named_buffers())
    assert set(tensors) == {"a.weight", "a.bias", "c.weight", "scale"}  # the tie is named once
    x = torch.randn(4, 5)
    want = functional_call(real, tensors, (x,))
    meta = Tied().to("meta")
    found = members(meta)
    assert {m.key for m in found if m.attr == "weight" and m.module is meta.b} == {"a.weight"}
    bind(found, tensors)
    torch.testing.assert_close(meta(x), want, rtol=0, atol=0)
    assert meta.b.weight is tensors["a.weight"] and meta.scale is tensors["scale"]
    unbind(found)
    assert meta.a.weight.is_meta and isinstance(meta.a.weight, nn.Parameter) and meta.scale.is_meta


def test_gradients_reach_the_bound_leaves_as_through_functional_call():
    torch.manual_seed(0)
    real = Tied()
    leaves = {n: torch.randn_like(p).requires_grad_(True) for n, p in real.named_parameters()}
    x = torch.randn(3, 5)
    functional_call(real, leaves | dict(real.named_buffers()), (x,)).sum().backward()
    want = {n: torch.clone(t.grad) for n, t in leaves.items() if t.grad is not None}
    assert want.keys() == leaves.keys()
    for t in leaves.values():
        t.grad = None
    meta = Tied().to("meta")
    bind(members(meta), leaves | dict(real.named_buffers()))
    meta(x).sum().backward()
    for n, t in leaves.items():
        torch.testing.assert_close(t.grad, want[n], rtol=0, atol=0, msg=n)
