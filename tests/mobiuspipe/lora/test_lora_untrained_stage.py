"""LoRA stages with nothing to train (an embedding, a head without a targeted module) on every state tier: they keep
no optimizer state, and the run trains as with the states in host memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig
from mobiuspipe.lora.spec import LoraSpec


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 8)

    def forward(self, ids):
        return self.table(ids)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 10)

    def forward(self, x):
        return self.out(x)


def _loss(out, targets):
    return nn.functional.cross_entropy(out.flatten(0, 1).float(), targets.flatten())


def _train(memory: MemoryConfig | None, checkpoint=None) -> tuple[list[float], dict]:
    """Three steps; with `checkpoint` (a folder), the first saved there and the other two in a new Pipeline resumed
    from it."""
    torch.manual_seed(0)
    layers = [_Embedding(), _Block(), _Head()]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 10, (4, 3), generator=g)) for _ in range(3)]
    spec = LoraSpec(rank=2, alpha=2.0, targets=("proj",))  # stages 0 and 2 hold no adapter
    with Pipeline(layers, _loss, sample=batches[0], num_microbatches=2, num_stages=3, memory=memory, lora=spec) as pipe:
        return [pipe.train_batch(x, y).loss for x, y in batches], pipe.state_dict()


@pytest.mark.parametrize("weights", ["host", "ssd"])
def test_stages_without_adapters_on_the_ssd_tiers_train_as_in_host_memory(tmp_path, weights):
    """With memory.weights ssd such a stage crashed the Pipeline's construction: `range() arg 3 must not be zero`."""
    host_losses, host_weights = _train(None)
    ssd = MemoryConfig(optimizer="ssd", weights=weights, ssd_dir=str(tmp_path), host_budget_mb=4)
    for checkpoint in (None, tmp_path / "checkpoints"):
        losses, weights_after = _train(ssd, checkpoint)
        assert losses == host_losses
        assert all(torch.equal(weights_after[k], host_weights[k]) for k in host_weights)
