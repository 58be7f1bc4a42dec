"""LoRA over layers given as modules (not factories): rank 0 builds each layer twice, to profile it and to train it,
and a given module comes back the same object both times."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import LoraSpec, Pipeline


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _train(layers, x, y, lora: LoraSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(11)  # the adapters are drawn from the seed torch has when the Pipeline is made
    with Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=2, num_stages=3, lora=lora) as pipe:
        start = pipe.state_dict(frozen=False)
        losses = [pipe.train_batch(x, y).loss for _ in range(3)]
        return start, pipe.state_dict(frozen=False), losses


@pytest.mark.parametrize("base_dtype", [None, "nf4"])
def test_given_modules_train_their_adapters_as_factories_do(base_dtype):
    torch.manual_seed(0)
    built = [Block(8, 16), Block(16, 16), Block(16, 5)]
    x, y = torch.randn(6, 8), torch.randn(6, 5)
    lora = LoraSpec(rank=2, alpha=4.0, targets=("fc",), base_dtype=base_dtype)
    start, got, got_losses = _train([copy.deepcopy(m) for m in built], x, y, lora)
    _, want, want_losses = _train([lambda m=m: copy.deepcopy(m) for m in built], x, y, lora)
    assert len(want) == 6 and got.keys() == want.keys()  # A and B of each layer's fc
    assert all(not torch.equal(start[k], want[k]) for k in want if k.endswith("lora_B.weight"))
    assert got_losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
