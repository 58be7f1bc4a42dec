"""The plan a Pipeline follows: given, read from a plan file, or made from a measured profile of its layers;
checked against those layers and the job before any work.

Every rank must follow the same plan. A given plan is compared across ranks by digest; a plan made from
a profile is made on rank 0 (timings differ between processes) and broadcast to the others.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mobiuspipe.errors import PipelineError, WorldSizeError
from mobiuspipe.profiling.profiler import TORCH_DTYPES, measure_profile
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.standin.places import gpu_of
from mobiuspipe.startup.machine import discovered_topology
from partition import make_plan
from partition.plan import Plan, load_plan
from topology import Topology, cpu_standin, load_topology
from topology.presets import STANDIN_MESSAGES, reserve_bytes

__all__ = [
    "PlanRequest",
    "check_precision",
    "PlanSource",
    "STANDIN_MEMORY_BYTES",
    "read_plan",
    "check_world",
    "check_batch",
    "check_cut",
    "check_stage_layers",
    "hang_warning",
    "same_plan_everywhere",
    "plan_from_profile",
]

PlanSource = Plan | str | os.PathLike | None
"""What a Pipeline is given as its plan: a Plan, the path of a plan file, or None (profile and plan)."""
STANDIN_MEMORY_BYTES = 1 << 30
"""Memory budget of each CPU stand-in device when a Pipeline plans for itself without a topology (bytes)."""


def read_plan(plan: Plan | str | os.PathLike) -> Plan:
    """The Plan itself, or the plan in a file written by `mobiuspipe partition -o`."""
    return plan if isinstance(plan, Plan) else load_plan(os.fspath(plan))


def check_world(plan: Plan, info: RankInfo) -> None:
    """The job must have one rank per gpu of the plan (checked before the process group exists)."""
    if plan.num_gpus == info.world_size:
        return
    if not info.under_torchrun:
        raise WorldSizeError(
            f"the plan has {plan.num_gpus} gpus but this process is not part of a torchrun job: "
            f"run `torchrun --nproc_per_node {plan.num_gpus} ...` or re-plan for 1 gpu"
        )
    raise WorldSizeError(
        f"the plan has {plan.num_gpus} gpus but torchrun started {info.world_size} ranks: run "
        f"`torchrun --nproc_per_node {plan.num_gpus} ...` or re-plan for {info.world_size} gpus"
    )


def check_precision(plan: Plan, precision: str | None) -> str:
    """The training precision: the plan's dtype, which an explicitly asked precision must equal."""
    if precision is not None and precision != plan.dtype:
        raise PipelineError(
            f"the plan is for {plan.dtype} weights but the precision asked for is {precision}: make a plan for "
            f"{precision} (`mobiuspipe partition --dtype {precision} ...`) or train in {plan.dtype}"
        )
    return plan.dtype


def check_batch(plan: Plan, passes: int, x, y) -> None:
    """A batch (inputs x, targets y) must be host tensors holding `passes` times the plan's microbatches along
    dimension 0."""
    for t, which in ((x, "inputs"), (y, "targets")):
        where = _device_of(t)
        if where is not None:
            raise PipelineError(
                f"the batch's {which} are on {where}; train_batch and eval_batch take host tensors (the pipeline "
                f"copies each microbatch to its gpu itself, through pinned memory, ahead of the stages' loads): "
                f"pass {which} as {which}.cpu()"
            )
    m, b = plan.num_microbatches, plan.microbatch_size
    want = passes * m * b
    if x.dim() == 0 or x.shape[0] != want or y.dim() == 0 or y.shape[0] != want:
        of = f"{passes} passes of " if passes > 1 else ""
        raise PipelineError(
            f"a batch needs {want} rows along dimension 0 ({of}the plan's {m} "
            f"microbatches of {b}); found inputs of shape "
            f"{tuple(x.shape)} and targets of shape {tuple(y.shape)}: batch the data to that "
            f"size or re-plan with --microbatches/--microbatch-size"
        )


def _device_of(t: torch.Tensor) -> str | None:
    """Where a tensor that is not host memory lives ("cuda:1", or a CPU stand-in's "gpu 0"); None for host memory."""
    if t.device.type != "cpu":
        return str(t.device)
    gpu = gpu_of(t)
    return None if gpu is None else f"gpu {gpu}"


def check_cut(plan: Plan, num_layers: int, num_microbatches: int | None) -> None:
    """The plan must cut this many layers into the asked number of microbatches."""
    if plan.num_layers != num_layers:
        raise PipelineError(
            f"the plan cuts {plan.num_layers} layers but the pipeline was given {num_layers}: make "
            f"a plan for these layers (or give no plan and a sample batch to plan from a profile)"
        )
    if num_microbatches is not None and num_microbatches != plan.num_microbatches:
        raise PipelineError(
            f"the plan is for {plan.num_microbatches} microbatches, {num_microbatches} were asked "
            f"for: make them equal or re-plan with --microbatches {num_microbatches}"
        )


HANG_PASSES = 3
"""Pipeline passes (at the plan's predicted time each) that hang_timeout_s should outlast: NCCL times an operation
from its post, and a receive posted at a pass's start may end with it."""


def hang_warning(gpus: int, pass_s: float, hang_timeout_s: float) -> str | None:
    """What to tell a job of `gpus` ranks whose hang_timeout_s (s) a few of its passes (pass_s each: the plan's
    predicted step) would outlive, or None."""
    if gpus < 2 or HANG_PASSES * pass_s <= hang_timeout_s:
        return None
    return (
        f"runtime.hang_timeout_s is {hang_timeout_s:g} s but the plan predicts {pass_s:.0f} s a pass: NCCL times "
        f"each message from its post, so a slow pass could end the job as a hang; raise runtime.hang_timeout_s to "
        f"{HANG_PASSES} passes or more ({HANG_PASSES * pass_s:.0f} s)"
    )


def check_stage_layers(plan: Plan, j: int, layers: dict[int, nn.Module]) -> None:
    """Stage j's layers have the plan's parameter count, and fit its slot."""
    s = plan.stages[j]
    params = [p for l in range(s.first, s.last + 1) for p in layers[l].parameters()]
    n, size = sum(p.numel() for p in params), TORCH_DTYPES[plan.dtype].itemsize
    nbytes = sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in params)  # int8, NF4: codes
    if n != s.param_count or nbytes > plan.slot_bytes:
        frozen = sum(
            p.numel() for l in range(s.first, s.last + 1) for p in layers[l].parameters() if not p.requires_grad
        )
        adapters = (
            f" ({n - frozen} trainable beside {frozen} frozen: with LoRA, the adapters, which a plan of the model "
            f"alone leaves out)"
            if frozen
            else ""
        )
        raise PipelineError(
            f"stage {j} (layers {s.first}..{s.last}) has {n} parameters ({nbytes} {plan.dtype} bytes) "
            f"in these layers{adapters}, the plan says {s.param_count} in a {plan.slot_bytes}-byte slot: "
            f"the plan was made for other layers or another dtype; re-plan for these layers (with lora=, plan "
            f"with sample=: the layers are measured with their adapters)"
        )


def same_plan_everywhere(plan: Plan, info: RankInfo) -> None:
    """Every rank must follow the same plan (each made or read its own): compare digests before any work."""
    if info.world_size == 1:
        return
    what = {k: v for k, v in plan.to_dict().items() if k != "solver"}  # the solver's wall time differs
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    digests: list[str | None] = [None] * info.world_size
    dist.all_gather_object(digests, digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise WorldSizeError(
            f"rank {info.rank}: ranks {differ} follow a different plan than rank 0 (different plan "
            f"files, configs or code versions); give every rank the same plan"
        )


@dataclass(frozen=True)
class PlanRequest:
    """What a Pipeline that plans for itself asks of the plan."""

    num_microbatches: int = 4
    num_stages: int | None = None
    """None: the fastest stage count."""
    mapping: str = "cross"
    topology: Topology | str | None = None
    """A Topology, a preset name or a layout file; None: one stand-in (or this rank's gpu) per rank."""
    precision: str = "fp32"
    reserve_mb: float | None = None
    """MiB of each gpu the plan leaves alone (CUDA context, NCCL, the allocator); None: topology.presets.reserve_bytes'
    default (1 GiB on a gpu, none on a CPU stand-in)."""


def plan_from_profile(
    layers: list[Callable[[], nn.Module]],
    loss_fn,
    sample: tuple[torch.Tensor, torch.Tensor],
    info: RankInfo,
    request: PlanRequest,
) -> Plan:
    """Rank 0 measures every layer on one microbatch of `sample` and plans; every rank gets its plan (or its
    error: a rank 0 that cannot plan fails every rank with the same message)."""
    result: list[object] = [None]
    if info.rank == 0:
        try:
            result[0] = _measure_and_plan(layers, loss_fn, sample, info, request)
        except Exception as e:  # noqa: BLE001 - handed to the other ranks below, then raised here too
            result[0] = e if _picklable(e) else PipelineError(f"rank 0 could not plan: {type(e).__name__}: {e}")
    if info.world_size > 1:
        dist.broadcast_object_list(result, src=0)
    payload = result[0]
    if isinstance(payload, Exception):
        raise payload
    if not isinstance(payload, dict):
        raise RuntimeError(f"rank {info.rank}: rank 0 sent {type(payload).__name__} instead of a plan")
    return Plan.from_dict(payload)


def _picklable(e: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001 - any failure to round-trip: send a plain PipelineError instead
        return False


def _measure_and_plan(layers, loss_fn, sample, info: RankInfo, request: PlanRequest) -> dict:
    x, y = sample
    m, dtype = request.num_microbatches, TORCH_DTYPES[request.precision]
    if x.shape[0] % m:
        raise PipelineError(f"the sample batch has {x.shape[0]} rows, not a multiple of num_microbatches={m}")
    # one microbatch in storage of its own, as the runtime holds it (a slice would count the batch's bytes)
    xm, ym = x[: x.shape[0] // m].clone(), y[: y.shape[0] // m].clone()
    xm = xm.to(dtype) if xm.is_floating_point() else xm
    device = torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    # measured in the training dtype, on copies: the layers given keep their fp32 weights for the master copy
    built = [make() if dtype == torch.float32 else copy.deepcopy(make()).to(dtype) for make in layers]
    _check_precision(built, request.precision)
    profile = measure_profile(
        built,
        xm,
        device=device,
        name="pipeline",
        device_name=_device_name(device),
        dtype_name=request.precision,
        microbatch_size=xm.shape[0],
        seq_len=xm.shape[1] if xm.dim() > 1 else 1,
        loss_fn=lambda out: loss_fn(out.float(), ym.to(out.device)),
        microbatches=m,
    )
    profile = dataclasses.replace(profile, target_bytes=ym.numel() * ym.element_size())
    topo = _topology(request.topology, info, device)
    plan = make_plan(
        profile,
        topo,
        m,
        num_stages=request.num_stages,
        mapping=request.mapping,
        solver="dp",
        reserve_bytes=reserve_bytes(topo, request.reserve_mb),
    )
    return plan.to_dict()


def _check_precision(built: list[nn.Module], precision: str) -> None:
    """PipelineError when a layer given in another floating dtype than fp32 is to be trained in fp32 (the profiler's
    own check would name its dtype_name, not the Pipeline's precision=). Integer parameters are a quantized base's."""
    if precision != "fp32":  # the layers are cast copies (_measure_and_plan)
        return
    for l, layer in enumerate(built):
        other = sorted({str(p.dtype) for p in layer.parameters() if p.is_floating_point()} - {str(torch.float32)})
        if other:
            raise PipelineError(
                f"layer {l} has {', '.join(other)} parameters, but the Pipeline trains in precision='fp32' (the "
                f"default): pass precision='bf16' (or 'fp16') to train in that dtype, or give the layers in fp32 "
                f"(the pipeline keeps an fp32 master copy and loads the precision's weights itself)"
            )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-standin"


def _topology(topology: Topology | str | None, info: RankInfo, device: torch.device) -> Topology:
    """The given topology (a preset name or layout file), else the discovered gpus of the job's ranks, else
    one stand-in per rank with this device's memory, whose messages cost what they typically do (STANDIN_MESSAGES,
    as a run from a config plans with)."""
    if isinstance(topology, Topology):
        return topology
    if topology is not None:
        return load_topology(topology)
    if device.type == "cuda":
        return discovered_topology(info.world_size)
    return cpu_standin(info.world_size, STANDIN_MEMORY_BYTES, measured=STANDIN_MESSAGES)
