"""One rank of the slow-peer test (started by test_slow_peer.py): a 2-rank Pipeline whose rank 0 spends longer than
the communication timeout in one forward of step 1, as a rank does that writes a checkpoint or sets up SSD states
while its peer waits; prints each step's loss."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from mobiuspipe import Pipeline


class Stall(nn.Module):
    """The identity, that sleeps `armed` seconds in its next forward once armed (then disarms)."""

    armed = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds, Stall.armed = Stall.armed, 0.0
        time.sleep(seconds)
        return x


def main(stall_s: float, comm_timeout_s: float) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    width = 16
    makers = [
        lambda: nn.Sequential(nn.Linear(width, width), Stall()),  # stage 0: rank 0's
        lambda: nn.Linear(width, width),
        lambda: nn.Linear(width, width),
        lambda: nn.Linear(width, width),
    ]
    x, y = torch.randn(4, width), torch.randn(4, width)  # a batch: 2 microbatches of 2
    with Pipeline(
        makers,
        nn.functional.mse_loss,
        sample=(x, y),
        num_microbatches=2,
        num_stages=4,
        comm_timeout_s=comm_timeout_s,
    ) as pipe:
        for step in range(3):
            Stall.armed = stall_s if step == 1 else 0.0
            start = time.monotonic()
            loss = pipe.train_batch(x, y).loss
            took = time.monotonic() - start
            print(f"rank {os.environ['RANK']} step {step} loss {loss:.6f} took {took:.1f} s", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
