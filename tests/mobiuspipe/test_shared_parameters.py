"""A parameter two given layers share (a tied embedding and head built as one tensor): the pipeline keeps each
stage's weights apart, so an undeclared share would train as two parameters; it is refused, naming the pair to
give as `tied`, and trains as one when given so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.errors import PipelineError


class Head(nn.Module):
    """The output layer over the embedding's table (its weight is the embedding's)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.T


def _layers():
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    return [emb, nn.Sequential(nn.Linear(6, 6), nn.Tanh()), Head(emb)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_an_undeclared_shared_parameter_is_refused_naming_the_pair():
    x = torch.randint(0, 11, (4, 5))
    with pytest.raises(PipelineError, match=r"layers 0 and 2 share a parameter .*tied=\[\('0.weight', '2.weight'\)\]"):
        Pipeline(_layers(), _loss, sample=(x, x), num_microbatches=2, num_stages=3)


def test_a_declared_shared_parameter_trains_as_one():
    x = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    with Pipeline(
        _layers(), _loss, sample=(x, x), num_microbatches=2, num_stages=3, tied=[("0.weight", "2.weight")]
    ) as p:
        for _ in range(3):
            p.train_batch(x, x)
        weights = p.state_dict()
    assert torch.equal(weights["0.weight"], weights["2.weight"])
