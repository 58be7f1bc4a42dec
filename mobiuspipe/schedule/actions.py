"""Typed actions of a Mobius schedule, with a compact string form ("F2.1" = forward of stage 2, microbatch 1).

Glossary: stage j (a contiguous range of layers), microbatch i, gpu g. Weights move host -> device arena
(LOAD, RELEASE); gradients move device -> host (OFFLOAD, which also starts the stage's host update); a
stage whose held activations live off the device starts their copy out in F and moves them back for B
(SWAP_OUT, SWAP_IN).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Kind", "Action"]


class Kind(Enum):
    LOAD = "L"  # start copying stage j's weights into a free arena slot (prefetch)
    FWD = "F"  # forward of (j, i); keeps the stage input (on the device, or its swap tier) for B to recompute from
    SEND_ACT = "SA"  # send the output of (j, i) to the gpu of stage j+1
    RECV_ACT = "RA"  # receive the input of (j, i) from the gpu of stage j-1
    BWD = "B"  # recompute (j, i) with grad, then backward; gradients accumulate in the arena
    SEND_GRAD = "SG"  # send the gradient of (j, i)'s input to the gpu of stage j-1
    RECV_GRAD = "RG"  # receive the gradient of (j, i)'s output from the gpu of stage j+1
    OFFLOAD = "O"  # copy stage j's gradients to host, free the gradient slot, start its host update
    RELEASE = "R"  # free stage j's weight slot
    SWAP_OUT = "SO"  # the copy of (j, i)'s held activations to their tier has ended: their device bytes go
    SWAP_IN = "SI"  # start copying (j, i)'s held activations back to the device (B(j, i) waits for it)


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int = -1

    def __str__(self) -> str:
        mb = f".{self.microbatch}" if self.microbatch >= 0 else ""
        return f"{self.kind.value}{self.stage}{mb}"
