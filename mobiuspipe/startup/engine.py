"""One rank's gpu (its Device) and Engine wired from its built stages and the settled plan: schedules, arena, channels,
swaps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mobiuspipe.config import MemoryConfig
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.optim.host_threads import pinned_to, update_cores_of
from mobiuspipe.runtime.action_trace import ActionTrace
from mobiuspipe.runtime.activations import StageMode
from mobiuspipe.runtime.engine import Engine, LossFn
from mobiuspipe.runtime.peers.channels import LAYOUT
from mobiuspipe.runtime.peers.comm import Comm
from mobiuspipe.runtime.peers.ranks import Membership, RankInfo
from mobiuspipe.runtime.stage import Stage
from mobiuspipe.schedule import build_schedules, receives_ahead
from mobiuspipe.startup.channels import open_channels
from mobiuspipe.startup.swaps import make_swaps, plan_as_run, swap_tiers
from partition.plan import Plan
from partition.rules.costmodel import WEIGHT_SLOTS
from partition.rules.lifetimes import send_releases

__all__ = ["rank_device", "wire_engine"]


def rank_device(plan: Plan, info: RankInfo) -> Device:
    """The rank's gpu, its host-work threads (updater, finisher, SSD and activation threads) pinned to the cores of
    the gpu's NUMA node where the plan's topology knows them (mobiuspipe.optim.host_threads), and the calling thread
    too: it makes and page-locks the stages' host buffers (weights, gradients, fp32 masters), whose pages land on the
    node of the core that first touches them, and a page-locked page never moves (as torchrun --numa-binding would
    pin the whole rank)."""
    device = Device(info.local_rank)
    pin = pinned_to(update_cores_of(plan.layout, info.rank, device.is_cuda))
    pin()
    device.keep_host_work_near(pin)
    return device


def wire_engine(
    plan: Plan,
    info: RankInfo,
    group: Membership,
    stages: dict[int, Stage],
    device: Device,
    loss_fn: LossFn,
    dtype: torch.dtype,
    memory: MemoryConfig,
    activations: dict[int, StageMode],
    trace: ActionTrace,
    tied: Sequence[tuple[str, str]],
) -> tuple[Plan, Engine]:
    """The plan as this run runs it (plan_as_run: its walk is the run's) and the Engine of this rank's stages. plan:
    with its state tiers settled (startup.tiers.with_tiers); group: the rank's membership (its timeouts and watch)."""
    m, swapped = plan.num_microbatches, swap_tiers(plan, memory, activations)
    as_run = plan_as_run(plan, activations, swapped)
    schedules = build_schedules(plan.mapping, plan.num_gpus, m, frozenset(swapped), LAYOUT)
    ledger = DeviceLedger()  # the arena, comm and engine count what they hold on the device
    channels = open_channels(info, plan, tied, group.hang_timeout_s)
    comm = Comm(info.rank, group.comm_timeout_s, ledger, channels, device.place, group.liveness, device.bind_thread)
    comm.warm_up(device.torch_device)
    engine = Engine(
        mapping=plan.mapping,
        rank=info.rank,
        stages=stages,
        schedule=schedules[info.rank],
        device=device,
        arena=DeviceArena(
            plan.slot_bytes, WEIGHT_SLOTS, device.torch_device, ledger, device.place, plan.grad_slot_bytes
        ),
        comm=comm,
        loss_fn=loss_fn,
        num_microbatches=m,
        dtype=dtype,
        ledger=ledger,
        activations=activations,
        swaps=make_swaps(swapped, as_run, device, memory, info, ledger),
        trace=trace,
        ahead=receives_ahead(plan.mapping, schedules)[info.rank],
        releases=send_releases(tuple(plan.mapping), info.rank, m) if channels.reports_completion else None,
    )
    return as_run, engine
