"""Layers a user hands the Pipeline in gpu memory (built with device="cuda", or moved with .cuda()): the pipeline
keeps the weights in host memory and loads each stage into its gpu itself, so it takes them off the gpu (with a
warning) and trains them as it trains the same layers given in host memory. On the stand-in, under strict mode,
such a layer's tensors are marked as gpu 0's memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.standin.places import gpu_of, on_gpu


class Block(nn.Module):
    """A linear layer, a norm and a float buffer (a mask, as nanoGPT-style blocks register)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x)) * self.scale)


def on_the_gpu(layer: nn.Module) -> nn.Module:
    """What .cuda() does to layer, on the stand-in: its parameters and buffers marked as gpu 0's (shared ones
    stay shared)."""
    made: dict[int, torch.Tensor] = {}
    for mod in layer.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(on_gpu(p.detach(), 0), p.requires_grad)
            setattr(mod, name, made[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, on_gpu(b, 0))
    return layer


def _train(layers, x, y, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    with Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=2, num_stages=3, precision=precision) as pipe:
        losses = [pipe.train_batch(x, y).loss for _ in range(3)]
        return losses, pipe.state_dict()


@pytest.mark.parametrize("given", ["modules", "factories"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_layers_in_gpu_memory_train_as_the_same_layers_in_host_memory(monkeypatch, precision, given):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    torch.manual_seed(0)
    built = [Block(8, 16), Block(16, 16), Block(16, 5)]
    x, y = torch.randn(6, 8), torch.randn(6, 5)
    want_losses, want = _train([copy.deepcopy(m) for m in built], x, y, precision)
    if given == "modules":
        layers = [on_the_gpu(copy.deepcopy(m)) for m in built]
    else:
        layers = [lambda m=m: on_the_gpu(copy.deepcopy(m)) for m in built]
    with pytest.warns(RuntimeWarning, match=r"in gpu memory: mobiuspipe moved it to host memory"):
        got_losses, got = _train(layers, x, y, precision)
    assert got_losses == want_losses
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(gpu_of(t) is None for t in got.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_layers_train_as_the_same_layers_in_host_memory(precision):
    torch.manual_seed(0)
    built = [Block(8, 16), Block(16, 16), Block(16, 5)]
    x, y = torch.randn(6, 8), torch.randn(6, 5)
    want_losses, want = _train([copy.deepcopy(m) for m in built], x, y, precision)
    with pytest.warns(RuntimeWarning, match=r"in gpu memory: mobiuspipe moved it to host memory"):
        got_losses, got = _train([copy.deepcopy(m).cuda() for m in built], x, y, precision)
    assert got_losses == want_losses
    assert all(torch.equal(got[k], want[k]) and not got[k].is_cuda for k in want)


def test_a_default_device_other_than_the_cpu_is_refused_naming_it():
    """torch.set_default_device("cuda") would put the host tiers' buffers on the gpu (here "meta" plays it)."""
    from mobiuspipe.errors import PipelineError

    x, y = torch.randn(6, 8), torch.randn(6, 5)
    layers = [Block(8, 16), Block(16, 5)]
    torch.set_default_device("meta")
    try:
        with pytest.raises(PipelineError, match=r"torch.set_default_device\('meta'\) .*set_default_device\('cpu'\)"):
            Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=2, num_stages=2)
    finally:
        torch.set_default_device(None)
