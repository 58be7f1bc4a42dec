"""Train your own nn.Module through mobiuspipe's Pipeline: a residual MLP regressor cut into 4 stages.

torchrun --nproc_per_node 2 examples/custom_module.py  (or plain `python`: 1 rank runs all 4 stages)
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.optim import CPUAdam

IN, WIDTH, OUT, BLOCKS = 12, 48, 3, 6
BATCH, MICROBATCHES, STAGES = 16, 4, 4


class Residual(nn.Module):
    """x + MLP(LayerNorm(x))."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_layer(l: int, seed: int = 0) -> nn.Module:
    """Layer l: the input projection, BLOCKS residual blocks, the output head; its own seed."""
    torch.manual_seed(seed * 1000 + l)
    if l == 0:
        return nn.Linear(IN, WIDTH)
    if l <= BLOCKS:
        return Residual(WIDTH)
    return nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, OUT))


def layer_factories(seed: int = 0) -> list:
    """One factory per layer: each rank builds only the layers of its own stages."""
    return [partial(make_layer, l, seed) for l in range(BLOCKS + 2)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank: x ~ N(0, 1), y = a fixed smooth function of x."""
    g = torch.Generator().manual_seed(1234 + step)
    x = torch.randn(BATCH, IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    return x, torch.sin(x @ teacher / IN**0.5)


def optimizer(params):
    return CPUAdam(params, lr=3e-3, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", help="write losses.json and weights-rank{r}.pt here")
    args = p.parse_args()
    torch.set_num_threads(1)
    # No plan given: rank 0 profiles the layers on one microbatch of the sample and plans; all ranks follow.
    with Pipeline(
        layer_factories(),
        F.mse_loss,
        optimizer=optimizer,
        sample=batch(0),
        num_microbatches=MICROBATCHES,
        num_stages=STAGES,
    ) as pipe:
        if pipe.rank == 0:
            print(f"{pipe.plan.num_stages} stages on {pipe.plan.num_gpus} ranks, stage -> rank {pipe.plan.mapping}")
        losses = []
        for step in range(args.steps):
            losses.append(pipe.train_batch(*batch(step)).loss)
            if pipe.rank == 0 and (step + 1) % 10 == 0:
                print(f"step {step + 1}: loss {losses[-1]:.4f}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(pipe.state_dict(), out / f"weights-rank{pipe.rank}.pt")
            if pipe.rank == 0:
                (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
