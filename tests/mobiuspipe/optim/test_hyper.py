"""The tiers that step the states themselves (out of core on the SSD, torch's AdamW on the gpu) run AdamW with the
hyper-parameters read off the optimizer factory: any other optimizer, or an AdamW variant they do not run, is refused
naming it, where it would otherwise be swapped for plain AdamW without a word."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from mobiuspipe.errors import PipelineError
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.hyper import AdamHyper


@pytest.mark.parametrize(
    "make",
    [partial(CPUAdam, lr=0.1, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.2), partial(torch.optim.AdamW, lr=0.1)],
)
def test_adamw_gives_its_hyper_parameters(make):
    h = AdamHyper.of(make)
    assert h.lr == 0.1 and (h.eps == 1e-7 or make.func is torch.optim.AdamW)


@pytest.mark.parametrize(
    "make, found",
    [
        (torch.optim.RAdam, "RAdam"),
        (torch.optim.NAdam, "NAdam"),
        (torch.optim.Adamax, "Adamax"),
        (torch.optim.Adam, "Adam"),
        (torch.optim.SGD, "SGD"),
        (partial(torch.optim.AdamW, amsgrad=True), "AdamW with amsgrad"),
        (partial(torch.optim.AdamW, maximize=True), "AdamW with maximize"),
    ],
)
def test_another_optimizer_is_refused_naming_it_and_the_tier(make, found):
    with pytest.raises(PipelineError, match=rf"on the gpu \(memory.optimizer: device\) .* makes an? {found}\b"):
        AdamHyper.of(make, "on the gpu (memory.optimizer: device)")
