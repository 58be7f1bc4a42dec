"""Runs of a small GPT with dropout under each activation mode: the helpers of the 1-rank and 2-rank tests."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import RunConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.arena import DeviceArena, Slot
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config
from partition.plan import Plan

DROPOUT = 0.2


class Dropped(nn.Module):
    """A layer followed by dropout (the same parameters as the layer, so the plan's counts still hold)."""

    def __init__(self, layer: nn.Module, p: float):
        super().__init__()
        self.layer, self.p = layer, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.layer(x), self.p, self.training)


def config(num_gpus: int = 1, precision: str = "fp32", accumulation: int = 2, blocks: int = 10) -> RunConfig:
    """A GPT of blocks + 2 layers cut into 4 stages on num_gpus CPU stand-ins, 4 microbatches of 2."""
    return config_from_dict(
        {
            "model": {"num_blocks": blocks, "d_model": 32, "num_heads": 2, "seq_len": 16, "vocab_size": 256},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "train": {
                "steps": 3,
                "lr": 0.01,
                "seed": 5,
                "precision": precision,
                "accumulation_steps": accumulation,
                "weight_decay": 0.1,
            },
            "plan": {"num_gpus": num_gpus, "num_stages": 4, "device_memory_mb": 256, "mapping": "cross"},
        }
    )


def _dropped(make, p: float) -> nn.Module:
    return Dropped(make(), p)


def layers(cfg: RunConfig, p: float = DROPOUT) -> list:
    """The GPT's layer factories, every layer but the head followed by dropout p."""
    makers = layer_factories(model_spec(cfg), cfg.train.seed)
    return [partial(_dropped, m, p) for m in makers[:-1]] + makers[-1:]


def choices(plan: Plan) -> dict[str, object]:
    """Named activations= arguments: whole-run modes, selective with several kept sets, and a mix."""

    def each(pick) -> dict[int, object]:
        return {j: ("selective", pick(list(s.layers))) for j, s in enumerate(plan.stages)}

    return {
        "recompute": "recompute",
        "keep": "keep",
        "none": each(lambda ls: []),
        "all": each(lambda ls: ls),
        "first": each(lambda ls: ls[:1]),
        "middle": each(lambda ls: ls[1:-1]),
        "ends": each(lambda ls: [ls[0], ls[-1]]),
        "mixed": {0: "keep", 1: ("selective", list(plan.stages[1].layers)[1:]), 2: "recompute"},
    }


@dataclass
class Run:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    peaks: list[int]
    """This rank's measured device peak of each step."""
    parts: dict[str, int]
    """The ledger's bytes by kind at this rank's peak of the run."""
    compute_s: float
    """This rank's compute seconds, summed over the steps after the first."""


def run(cfg: RunConfig, activations, steps: int = 3, p: float = DROPOUT) -> Run:
    """Train steps steps of the dropout GPT under `activations` (a new Pipeline, the global seed set first)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    rows = t.accumulation_steps * cfg.data.batch_size
    losses, peaks, compute = [], [], 0.0
    with Pipeline(
        layers(cfg, p),
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=opt,
        precision=t.precision,
        accumulation_steps=t.accumulation_steps,
        activations=activations,
    ) as pipe:
        for step in range(steps):
            r = pipe.train_batch(*data.batch(step, rows))
            losses.append(r.loss)
            peaks.append(r.own_device_peak_bytes)
            compute += r.own_times.compute_s if step else 0.0
        weights = pipe.state_dict()
        parts = dict(pipe.engine.peak.run_parts)
    return Run(losses, weights, peaks, parts, compute)


def rotate_slots(arena_cls=DeviceArena) -> None:
    """Give the arena a third weight slot and fill a released slot with NaNs. A stage then lands in another arena
    slot at its backward than at its forward (acquire takes the slot freed longest ago), so a kept graph that read
    its weights from the slot of its forward would see another stage's weights or NaNs. (With the runtime's two
    weight slots a gpu's mirrored visits bring each stage back to the slot of its forward, and the same weights.)"""
    release, init = arena_cls.release, arena_cls.__init__

    def spare(self: DeviceArena, slot_bytes: int, num_slots: int, *args, **kwargs) -> None:
        init(self, slot_bytes, num_slots + 1, *args, **kwargs)

    arena_cls.__init__ = spare

    def poisoned(self: DeviceArena, slot: Slot, after=()) -> None:
        release(self, slot, after)
        for copy in slot.take_busy():  # a writer of the slot orders after the copies still reading it
            copy.synchronize()
        slot.data.fill_(0xFF)

    arena_cls.release = poisoned
