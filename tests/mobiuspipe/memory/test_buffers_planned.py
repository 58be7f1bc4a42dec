"""The layers' buffers in a Pipeline's own plan: its profile measures them, the plan counts them on their stage's gpu,
and the stand-in's ledger, which holds them the whole run, peaks that much higher, the walk still above it."""

from __future__ import annotations

import torch
from torch import nn

from mobiuspipe import Pipeline


class _Masked(nn.Module):
    """A block with a float table it adds (a causal mask's stand-in: a buffer read each forward, saving nothing)."""

    table: torch.Tensor

    def __init__(self, rows: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("table", torch.zeros(rows, 8))

    def forward(self, x):
        return torch.tanh(self.fc(x) + self.table[0])


def _run(rows: int) -> tuple[list[int], int, int]:
    """The plan's stages' buffer bytes, its stand-in walk and the ledger's peak over two steps."""
    torch.manual_seed(0)
    layers = [_Masked(rows), _Masked(rows), nn.Linear(8, 2)]
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    with Pipeline(layers, nn.functional.mse_loss, sample=(x, y), num_microbatches=3, num_stages=3) as pipe:
        for _ in range(2):
            pipe.train_batch(x, y)
        return [s.buffer_bytes for s in pipe.plan.stages], pipe.planned_device_bytes()[0], pipe.engine.peak.run_bytes


def test_the_plan_counts_the_buffers_the_ledger_holds():
    bare, walk0, peak0 = _run(1)
    kept, walk1, peak1 = _run(4097)  # 128 KiB of buffers a block
    assert bare == [32, 32, 0] and kept == [4097 * 32, 4097 * 32, 0]
    added = 2 * 4096 * 32
    assert peak1 - peak0 == added  # the ledger holds both blocks' tables the whole run
    assert walk1 - walk0 == added and peak1 <= walk1  # the plan counts them, and its walk stays an upper bound
