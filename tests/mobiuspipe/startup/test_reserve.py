"""A Pipeline that plans for itself leaves the reserve it is given, and refuses one that is no number of MiB; a
hang timeout a few of the plan's passes would outlast is warned of."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.errors import PipelineError

SAMPLE = (torch.randn(4, 8), torch.randn(4, 8))


def _planned_memory(reserve_mb: float | None) -> int:
    layers = [nn.Linear(8, 8) for _ in range(3)]
    with Pipeline(layers, nn.functional.mse_loss, sample=SAMPLE, num_microbatches=2, reserve_mb=reserve_mb) as pipe:
        return pipe.plan.gpu_memory_bytes


def test_the_reserve_given_is_left_alone():
    assert _planned_memory(None) - _planned_memory(8.0) == 8 * 2**20  # a stand-in's default reserve is none


@pytest.mark.parametrize("reserve_mb", [-1.0, float("nan"), float("inf")])
def test_a_reserve_that_is_no_number_of_mib_is_refused(reserve_mb):
    with pytest.raises(PipelineError, match="reserve_mb .*: expected MiB >= 0"):
        Pipeline([nn.Linear(8, 8)], nn.functional.mse_loss, sample=SAMPLE, reserve_mb=reserve_mb)


def test_a_hang_timeout_shorter_than_a_few_passes_is_warned_of():
    from mobiuspipe.startup.plan import HANG_PASSES, hang_warning

    assert hang_warning(2, 600.0, 1800.0) is None
    why = hang_warning(2, 700.0, 1800.0)
    assert why is not None and "predicts 700 s a pass" in why and f"({HANG_PASSES * 700} s)" in why
    assert hang_warning(1, 700.0, 1800.0) is None  # one rank: nobody waits for a message
