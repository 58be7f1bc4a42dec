"""A GPT as a list of layers (embedding, transformer blocks, head), each initialized from its own seed.

The layer structure matches partition.spec.models parameter for parameter, so a plan's byte counts are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from partition.spec.models import ModelSpec

__all__ = ["Embedding", "Block", "Head", "skeleton", "build_layer", "build_layers", "layer_factories", "lm_loss"]


class Embedding(nn.Module):
    """Token + position embedding: (b, T) int64 -> (b, T, d)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos = nn.Embedding(spec.seq_len, spec.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(t)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d = spec.d_model
        self.heads = spec.num_heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (b, T, d) -> logits (b, T, V)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln = nn.LayerNorm(spec.d_model)
        self.lm = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def _init(layer: nn.Module, generator: torch.Generator, num_blocks: int) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 * blocks)."""
    for name, p in layer.named_parameters():
        if p.dim() == 1:
            p.data.fill_(1.0 if "ln" in name and name.endswith("weight") else 0.0)
            continue
        std = 0.02 / math.sqrt(2 * num_blocks) if name.split(".")[0] in ("proj", "out") else 0.02
        p.data.normal_(0.0, std, generator=generator)


def skeleton(spec: ModelSpec, l: int) -> nn.Module:
    """Layer l (embedding, block or head) with torch's default initialization (under torch.device("meta"): none)."""
    if l == 0:
        return Embedding(spec)
    if l == spec.num_layers - 1:
        return Head(spec)
    return Block(spec)


def build_layer(spec: ModelSpec, seed: int, l: int) -> nn.Module:
    """Layer l of the GPT (embedding, block or head), initialized on the CPU from seed (seed, l)."""
    layer = skeleton(spec, l)
    g = torch.Generator().manual_seed(seed * 1_000_003 + l)
    with torch.no_grad():
        _init(layer, g, spec.num_blocks)
    return layer


def build_layers(spec: ModelSpec, seed: int, which: list[int] | None = None) -> dict[int, nn.Module]:
    """Layers l (all by default) of the GPT, by layer number (see build_layer)."""
    return {l: build_layer(spec, seed, l) for l in (range(spec.num_layers) if which is None else which)}


def layer_factories(spec: ModelSpec, seed: int) -> list[Callable[[], nn.Module]]:
    """One factory per layer, so that a Pipeline rank builds only the layers of its own stages."""
    return [partial(build_layer, spec, seed, l) for l in range(spec.num_layers)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
