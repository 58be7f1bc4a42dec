"""Dropout under recompute: each stage's backward recomputes its forward with the random state that forward
started from, so the masks of the two passes are the same and the gradient is that of the activations the
next stage received."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.standin.places import plain


class RecordingDropout(nn.Module):
    """Linear then dropout; records every mask it draws, keyed by the input it drew it for."""

    def __init__(self, d: int, masks: dict):
        super().__init__()
        self.lin, self.masks = nn.Linear(d, d), masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape) > 0.3
        key = plain(x).detach().double().sum().item()  # the test's probe: a host read the strict pass would refuse
        self.masks.setdefault(key, []).append(keep)
        return self.lin(x) * keep / 0.7


def test_the_recompute_draws_the_forward_masks():
    torch.manual_seed(0)
    masks: dict = {}
    layers = [RecordingDropout(5, masks), RecordingDropout(5, masks), nn.Linear(5, 3)]
    x, y = torch.randn(12, 5), torch.randn(12, 3)
    with Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=4, num_stages=3, activations="recompute") as pipe:
        masks.clear()  # planning profiled the layers on the sample
        for step in range(2):
            pipe.train_batch(x + step, y)
    # stages 0 and 1 each run twice per microbatch (forward, then recompute); the last stage runs once
    assert len(masks) == 2 * 4 * 2  # 2 steps x 4 microbatches x 2 dropout stages, each with its own input
    for drawn in masks.values():
        assert len(drawn) == 2 and torch.equal(drawn[0], drawn[1])
    assert not torch.equal(*[next(iter(masks.values()))[0], list(masks.values())[1][0]])  # masks do vary


def _masks(activations) -> dict:
    torch.manual_seed(0)
    masks: dict = {}
    layers = [RecordingDropout(5, masks), RecordingDropout(5, masks), nn.Linear(5, 3)]
    x, y = torch.randn(12, 5), torch.randn(12, 3)
    with Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=4, num_stages=3, activations=activations) as p:
        masks.clear()
        torch.manual_seed(1)  # how many masks the profile drew depends on its timing
        for step in range(2):
            p.train_batch(x + step, y)
    return masks


def test_keep_draws_each_mask_once_and_the_recompute_draws_the_same():
    recompute, keep = _masks("recompute"), _masks("keep")
    selective = _masks({0: ("selective", [0]), 1: ("selective", [])})  # stage 0 keeps, stage 1 recomputes
    assert keep.keys() == recompute.keys() == selective.keys() and len(keep) == 2 * 4 * 2
    for k, drawn in keep.items():
        assert len(drawn) == 1 and torch.equal(drawn[0], recompute[k][0])
        assert len(selective[k]) in (1, 2) and all(torch.equal(m, recompute[k][0]) for m in selective[k])
    assert sorted(len(d) for d in selective.values()) == [1] * 8 + [2] * 8
