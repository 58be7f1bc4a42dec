"""The public API: Pipeline trains a list of layers as a Mobius pipeline on the ranks torchrun started.

    from mobiuspipe import Pipeline

    pipe = Pipeline(layers, loss_fn, plan="plan.yaml")     # or plan=None, sample=(x, y): profile and plan
    for x, y in batches:                                  # every rank calls with the same batch
        result = pipe.train_batch(x, y)                   # result.loss: the batch's mean loss
    weights = pipe.state_dict()                           # this rank's stages, named as nn.Sequential's
    pipe.close()

`layers` is an nn.Sequential, a list of modules, or a list of factories (zero-argument callables that
return a module), so that each rank builds only the layers of its own stages. Each layer takes one
tensor and returns one tensor. The Pipeline takes over the modules it is given: their weights move into
its host tier and the modules are left on the meta device (read the weights with state_dict()).
The torchrun entry (mobiuspipe.train) trains the built-in GPT through
this same class.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from foundation.shm import shm_space
from mobiuspipe import checkpoint
from mobiuspipe.config import MemoryConfig
from mobiuspipe.errors import PipelineError
from mobiuspipe.layers import LayerSpec, build, check_layers, factories
from mobiuspipe.lora.layers import Start, with_adapters
from mobiuspipe.lora.quant import quantized
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.memory.device import Device, on_compute_stream
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.clipping import clip_scale
from mobiuspipe.optim.hyper import GPU_TIER, AdamHyper
from mobiuspipe.optim.loss_scale import LossScaler, scaler_for
from mobiuspipe.profiling.profiler import TORCH_DTYPES
from mobiuspipe.runtime.action_trace import ActionTrace
from mobiuspipe.runtime.activations import ActivationsSpec, stage_modes
from mobiuspipe.runtime.engine import Engine, LossFn, StepOptions, StepTimes
from mobiuspipe.runtime.peers.ranks import Membership, rank_info
from mobiuspipe.runtime.stage import Stage
from mobiuspipe.runtime.states import SsdTier
from mobiuspipe.runtime.tied import TiedGrads
from mobiuspipe.startup.engine import rank_device, wire_engine
from mobiuspipe.startup.plan import (
    PlanRequest,
    PlanSource,
    check_batch,
    check_cut,
    check_precision,
    check_stage_layers,
    check_world,
    hang_warning,
    plan_from_profile,
    read_plan,
    same_plan_everywhere,
)
from mobiuspipe.startup.room import check_room, out_of_memory
from mobiuspipe.startup.shm import shm_error, shm_warning
from mobiuspipe.startup.tiers import agree_on_tiers, check_delayed, with_tiers
from mobiuspipe.startup.update_policy import UpdatePolicy
from mobiuspipe.step_result import StepResult
from partition.plan import Plan
from partition.rules.device_peak import planned_device_bytes
from topology import Topology

__all__ = ["Pipeline", "StepResult"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Makes the optimizer of one stage from its (one, flat, fp32, host) parameter."""


class Pipeline:
    """A model cut into the plan's stages, run on this rank's gpu with weights streamed from the host tier."""

    def __init__(
        self,
        layers: nn.Sequential | Sequence[LayerSpec],
        loss_fn: LossFn,
        *,
        plan: PlanSource = None,
        optimizer: OptimizerFactory | None = None,
        sample: tuple[torch.Tensor, torch.Tensor] | None = None,
        num_microbatches: int | None = None,
        num_stages: int | None = None,
        mapping: str = "cross",
        topology: Topology | str | None = None,
        reserve_mb: float | None = None,
        precision: str | None = None,
        loss_scaler: LossScaler | None = None,
        memory: MemoryConfig | None = None,
        comm_timeout_s: float = 60.0,
        hang_timeout_s: float = 1800.0,
        overlap_updates: bool = True,
        tied: Sequence[tuple[str, str]] = (),
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        activations: ActivationsSpec = None,
        trace_steps: Sequence[int] = (),
        lora: LoraSpec | None = None,
        adapters: Start | None = None,
        delayed_update: int | None = None,
        speculative_update: bool = True,
    ):
        """Build this rank's stages.

        plan: a Plan, the path of a plan file (`mobiuspipe partition -o`), or None to measure the layers on
          one microbatch of `sample` = (x, y) and plan for num_microbatches (default 4), num_stages (default:
          the fastest count), mapping ("cross", "round-robin", "search") on `topology` (a Topology, preset
          name or layout file; default one CPU stand-in or the gpu of each rank), leaving reserve_mb MiB of each gpu
          alone for the CUDA context, NCCL and the allocator (default 1 GiB on a gpu, none on a stand-in).
        optimizer: makes each stage's optimizer from its parameters (default CPUAdam with its defaults).
        precision: "fp32", "bf16" or "fp16", the dtype of the weights and gradients on the device (the master
          weights and the optimizer stay fp32 on the host); default the plan's dtype (fp32 when planning).
        loss_scaler: fp16 only; default LossScaler() (dynamic loss scaling, torch.amp's default rule).
        memory: where the master weights and Adam moments live (MemoryConfig: "host"; "ssd" under ssd_dir
          with host_budget_mb per rank; "auto": in memory while they fit host_budget_mb, the largest stages
          on SSD otherwise); default host. `self.placement` says where this rank's stages went,
          `self.state_tiers` where every stage of the job went.
        comm_timeout_s: a rank that gives no sign of life this long is lost (mobiuspipe.runtime.peers.liveness):
          every rank stops, naming it. hang_timeout_s: the process group's deadline, that ends a hang among live
          ranks (NCCL times an operation from its post: more than a step takes).
        overlap_updates: False starts the host updates only after the step's backward and waits for them
          before train_batch returns (the serialized baseline the overlap is measured against).
        tied: pairs of parameters, named as state_dict() names them ("0.wte.weight", "13.lm_head.weight"),
          that are one parameter of the model (tied embeddings): each half's stage keeps a copy, both copies
          must start equal, and both update with the sum of the two gradients (mobiuspipe.runtime.tied).
        accumulation_steps: pipeline passes per optimizer step; a batch is that many passes of the plan's
          microbatches, their gradients summed in the states' tiers before one update.
        max_grad_norm: clip the gradients so that their global L2 norm (over every stage and rank, a tied pair
          counted once) is at most this, as torch.nn.utils.clip_grad_norm_ does; None = no clipping. Every
          update then waits for the whole backward.
        activations: "recompute" (the stage input is saved, the forward rerun in the backward), "keep" (the
          forward's graph stays on the device until the backward) or {stage: "recompute" | "keep" | ("selective",
          [layer indices])} (mobiuspipe.runtime.activations); default memory.activations. Same numbers bit for bit.
        trace_steps: the optimizer steps (0-based) whose actions this rank times (`self.trace.records`, see
          mobiuspipe.runtime.action_trace).
        lora: train LoRA adapters (mobiuspipe.lora.LoraSpec: rank, alpha, dropout, target modules) beside the
          target linear layers, every other weight frozen: the frozen weights are loaded read-only from host
          memory in the training dtype and get no gradient, offload or optimizer state (`tied` pairs, frozen,
          need no exchange). A new adapter starts as PEFT's (B zero), drawn from torch's seed and the layer.
        adapters: with lora, a saved adapter to continue instead: layer index -> adapter parameter name in the
          layer ("layer.self_attn.q_proj.lora_A.weight") -> tensor (a PEFT adapter folder DIR of a Hugging Face
          model m: mobiuspipe.models.hf_export.adapter_layers(m, mobiuspipe.lora.peft_format.load_adapter(DIR)[1])).
        delayed_update: N, ZeRO-Offload's one-step delayed parameter update from optimizer step N on: step s >= N
          computes on the weights before the update of step s - 1, which runs on the host while step s computes
          (clipped or skipped as step s - 1 asked); the steps before N update before the next step loads. Every
          pending update is applied before state_dict(), a checkpoint or close() returns. None: off. The loaded
          weights and the offloaded gradients are then kept twice in host memory.
        speculative_update: with max_grad_norm or fp16, start each stage's update as its gradients arrive (not after a
          step that clipped or overflowed), keep what it overwrites, and once the step's checks are known keep it, or
          roll it back and redo (or drop) it: the held update's bits (train.speculative_update). False: they wait.
        """
        if accumulation_steps < 1 or (max_grad_norm is not None and not max_grad_norm > 0):
            raise PipelineError(
                f"accumulation_steps {accumulation_steps!r} must be >= 1 and max_grad_norm {max_grad_norm!r} "
                f"positive (or None for no clipping)"
            )
        if reserve_mb is not None and not 0 <= reserve_mb < 2**40:
            raise PipelineError(f"reserve_mb {reserve_mb!r}: expected MiB >= 0 (or None: 1 GiB on a gpu)")
        if delayed_update is not None and delayed_update < 0:
            raise PipelineError(
                f"delayed_update {delayed_update!r}: expected the first delayed optimizer step, >= 0 (or None: off)"
            )
        check_layers(layers, tied, frozen=lora is not None)
        self.accumulation_steps, self.max_grad_norm = accumulation_steps, max_grad_norm
        makers = factories(layers)
        if adapters is not None and lora is None:
            raise PipelineError("adapters= continues a saved LoRA adapter: give its LoraSpec as lora= beside it")
        if lora is not None:
            makers, tied = with_adapters(makers, lora, adapters), ()  # the base, tied halves included, is frozen
            if lora.base_dtype is not None:
                makers = quantized(makers, lora.base_dtype)
        self.info = rank_info()
        given = None if plan is None else read_plan(plan)
        if given is not None:
            check_world(given, self.info)  # before any process starts waiting for the others
        self.group = Membership(self.info, comm_timeout_s, hang_timeout_s)
        if (why := shm_warning(self.info, torch.cuda.is_available(), shm_space())) is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=2)
        try:
            request = PlanRequest(num_microbatches or 4, num_stages, mapping, topology, precision or "fp32", reserve_mb)
            self.plan = self._agree_on_plan(given, makers, loss_fn, sample, request)
            self.group.watch()  # from here on, a rank may be busy as long as it needs while it lives
            why = hang_warning(self.plan.num_gpus, self.plan.predicted_step_time_s, hang_timeout_s)
            if why is not None and self.info.rank == 0:
                warnings.warn(why, RuntimeWarning, stacklevel=2)
            self.precision = check_precision(self.plan, precision)
            self.scaler = scaler_for(self.precision, loss_scaler)
            self.memory = memory or MemoryConfig()
            self.activations = stage_modes(self.memory.activations if activations is None else activations, self.plan)
            self.overlap_updates = overlap_updates
            checked = self.scaler is not None or max_grad_norm is not None
            self.updates = UpdatePolicy(
                checked, overlap_updates, delayed_update, speculative_update, accumulates=accumulation_steps > 1
            )
            self.store: SSDStore | None = None
            self.trace = ActionTrace(trace_steps)
            self.engine = self._build_engine(makers, loss_fn, optimizer or partial(CPUAdam), num_microbatches, tied)
            planned, buffers = self.planned_device_bytes()[self.rank], self.engine.buffer_bytes
            check_room(self.info, planned, self.engine.device.torch_device, self.plan, buffers)
            self.ties = TiedGrads(tied, self.plan, self.engine.stages, self.info) if tied else None
            if self.ties is not None:
                self.engine.hold_updates_of(self.ties.held_stages)
        except BaseException as e:
            if (store := getattr(self, "store", None)) is not None:
                store.close()
            self.group.abort()
            self.group.close(failed=True)
            if (told := shm_error(e, shm_space())) is not None:
                raise told from e
            gpu = torch.device("cuda", self.info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
            if (told := out_of_memory(e, self.info.rank, gpu, getattr(self, "plan", None))) is not None:
                raise told from e
            raise
        self.step = 0
        self._lr: float | None = None  # set_lr: the rate of the updates of the next steps (None: the optimizer's)
        self._passed = True  # the last step neither clipped nor overflowed (UpdatePolicy.speculates)
        self._closed = False

    def _agree_on_plan(self, given: Plan | None, makers, loss_fn, sample, request: PlanRequest) -> Plan:
        """The given plan, checked to be every rank's, or the plan rank 0 makes from a profile of the layers."""
        if given is not None:
            same_plan_everywhere(given, self.info)
            return given
        if sample is None:
            raise PipelineError(
                "a Pipeline needs a plan (a Plan or a plan file) or a sample batch (x, y) to "
                "profile its layers and plan from: pass plan=... or sample=(x, y)"
            )
        return plan_from_profile(makers, loss_fn, sample, self.info, request)

    @property
    def rank(self) -> int:
        """This process's rank (= its gpu in the plan)."""
        return self.info.rank

    @property
    def stages(self) -> dict[int, Stage]:
        """This rank's stages by index (their weights, gradients and states; a checkpoint reads and restores them)."""
        return self.engine.stages

    @property
    def device(self) -> Device:
        """This rank's gpu (or its CPU stand-in)."""
        return self.engine.device

    def wait_updates(self) -> None:
        """Wait for every host update started so far (the last step's may still run after train_batch returns)."""
        self.engine.wait_updates()

    def device_peak(self) -> tuple[int, dict[str, int], str]:
        """This rank's measured device peak over the run: its bytes, what the ledger held then by kind, and where the
        figure comes from ("cuda allocator" or "ledger")."""
        peak = self.engine.peak
        return peak.run_bytes, peak.run_parts, peak.source

    def planned_device_bytes(self) -> list[int]:
        """The plan's device figure per gpu for the path this run takes: a gpu or the stand-in, and sends held to
        the step's end where the backend reports completion only then (partition.rules.device_peak)."""
        until_flush = not self.engine.comm.channels.reports_completion
        on_device = [j for j, (opt, _) in self.state_tiers.items() if opt == "device"]
        return planned_device_bytes(self.plan, not self.device.is_cuda, None, until_flush, on_device)

    def _build_engine(
        self,
        makers: list[Callable[[], nn.Module]],
        loss_fn: LossFn,
        make_optimizer: OptimizerFactory,
        num_microbatches: int | None,
        tied: Sequence[tuple[str, str]],
    ) -> Engine:
        plan, rank = self.plan, self.info.rank
        mine = plan.stages_of(rank)
        check_cut(plan, len(makers), num_microbatches)
        device = rank_device(plan, self.info)
        dtype = TORCH_DTYPES[self.precision]
        tiers = self._state_tiers(make_optimizer, {j: plan.stages[j].trains for j in mine})  # LoRA: the adapters
        check_delayed(self.updates.delayed_update, self.state_tiers)
        plan = with_tiers(plan, self.state_tiers)  # what the run does, forced settings included
        stages = {}
        for j in mine:  # one stage's layers at a time: they become its states before the next is built
            layers = {l: build(makers[l], l) for l in plan.stages[j].layers}
            check_stage_layers(plan, j, layers)
            on_ssd = self.placement.weights[j] == "ssd"
            frozen_store = self.store if self.memory.frozen == "ssd" else None
            on_device = AdamHyper.of(make_optimizer, GPU_TIER) if self.placement.optimizer[j] == "device" else None
            stages[j] = Stage(
                j,
                layers,
                device,
                make_optimizer,
                dtype,
                ssd=tiers[j],
                weights_on_ssd=on_ssd,
                frozen_store=frozen_store,
                on_device=on_device,
                versions=self.updates.copies.versions,
                accumulates=self.updates.copies.accumulates,
            )
        self.plan, engine = wire_engine(
            plan, self.info, self.group, stages, device, loss_fn, dtype, self.memory, self.activations, self.trace, tied
        )
        return engine

    def _state_tiers(self, make_optimizer: OptimizerFactory, params: dict[int, int]) -> dict[int, SsdTier | None]:
        """Stage j -> its SSD tier or None (host), agreed with every rank (mobiuspipe.startup.tiers)."""
        recorded = {j: (self.plan.stages[j].optimizer_tier, self.plan.stages[j].weights_tier) for j in params}
        self.placement, self.state_tiers, self.store, tiers = agree_on_tiers(
            self.info,
            self.memory,
            TORCH_DTYPES[self.precision].itemsize,
            make_optimizer,
            params,
            recorded,
            self.updates.copies,
        )
        return tiers

    def set_lr(self, lr: float) -> None:
        """The learning rate of the updates of the next train_batch calls (each update takes the rate set
        when it starts, so a change never reaches an update still running from an earlier step)."""
        if not (lr >= 0 and math.isfinite(lr)):  # 0: a schedule's last step decaying to min_lr 0
            raise PipelineError(f"set_lr needs a finite learning rate >= 0, not {lr!r}")
        self._lr = lr

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> StepResult:
        """train_batch(*batch)."""
        return self.train_batch(*batch)

    @on_compute_stream
    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """One optimizer step on the batch (inputs x, targets y: host tensors, the same on every rank), split into
        the plan's microbatches along dimension 0. Returns when this rank's part of the step is done (the host
        updates may still run; the next step waits for them where it needs their weights)."""
        self._check_batch(x, y)
        engine, start = self.engine, time.perf_counter()
        engine.arena.reset_peak()
        scale = self.scaler.scale if self.scaler else None
        loss, times, own_peak = self._passes(x, y, scale or 1.0)
        tied = self.ties.sum(engine.comm, engine.device, self.step) if self.ties else []
        sums, what = [loss, *self._grad_checks(tied)], f"the loss and gradient checks of step {self.step}"
        loss, sumsq, overflows = self._reduce(sums, torch.distributed.ReduceOp.SUM, what)
        c, ld, cm, peak, device_peak = self._reduce(
            [times.compute_s, times.load_s, times.comm_s, engine.arena.peak_bytes, own_peak],
            torch.distributed.ReduceOp.MAX,
            f"the metrics of step {self.step}",
        )
        skipped = self._skip_on_overflow(overflows > 0)
        norm, grad_scale = self._clip(sumsq, scale or 1.0)
        skipped = skipped or not math.isfinite(norm)  # an inf/nan gradient: no weight changes
        rolled_back, self._passed = engine.rolled_back, not skipped and grad_scale == (scale or 1.0)
        engine.start_updates(apply=not skipped, grad_scale=grad_scale)  # the updates held back, if any
        if not self.overlap_updates:
            engine.wait_updates()
        result = StepResult(
            step=self.step,
            loss=loss,
            times=StepTimes(c, ld, cm),
            arena_peak_bytes=int(peak),
            arena_budget_bytes=engine.arena.budget_bytes,
            loss_scale=scale,
            skipped=skipped,
            device_peak_bytes=int(device_peak),
            grad_norm=None if self.max_grad_norm is None else norm,
            own_times=times,
            own_device_peak_bytes=own_peak,
            updates_rolled_back=engine.rolled_back - rolled_back,
        )
        if self.trace.wants(self.step):
            self.trace.add(self.step, "step", -1, -1, start)
        self.step += 1
        return result

    def _passes(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float) -> tuple[float, StepTimes, int]:
        """Run the step's pipeline passes (accumulation_steps of them), the gradients of each added to the
        tiers' after the first; the updates start (or are held) in the last. This rank's loss, its times
        summed over the passes and its measured device peak of the step (read once the passes are issued)."""
        engine, k = self.engine, self.accumulation_steps
        for p, (xp, yp) in enumerate(zip(x.chunk(k), y.chunk(k))):
            last = p == k - 1
            options = StepOptions(
                step=self.step,
                passes=k,
                loss_scale=loss_scale,
                accumulate=p > 0,
                want_norm=last and self.max_grad_norm is not None,
                check_finite=last and self.scaler is not None,
                hold_updates=not last or self.updates.holds(self.step),
                speculate=last and self.updates.speculates(self.step, self._passed),
                lr=self._lr,
                lag=self.updates.delayed(self.step),
            )
            engine.run_step(xp, yp, options)
            if not last:
                engine.start_updates(apply=False)  # no update yet: their gradients wait in the tiers for the next pass
        loss, times = engine.end_step()
        return loss, times, engine.peak.step_bytes

    def _grad_checks(self, tied: list[torch.Tensor]) -> list[float]:
        """This rank's [squared gradient norm (0.0 without clipping; tied: the tied pairs' terms of it), 1.0 if its
        gradients overflowed (fp16)], summed over the ranks with the loss."""
        sumsq, overflowed = self.engine.grad_checks(self.max_grad_norm is not None, self.scaler is not None, tied)
        return [sumsq, float(overflowed)]

    def _clip(self, total_sumsq: float, loss_scale: float) -> tuple[float, float]:
        """(the global gradient norm, what the updates divide the gradients by: mobiuspipe.optim.clipping) from the
        squared norm summed over the ranks; (0.0, the loss scale) without clipping."""
        if self.max_grad_norm is None:
            return 0.0, loss_scale
        return clip_scale(total_sumsq, loss_scale, self.max_grad_norm)

    @on_compute_stream
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The batch's mean loss under the current weights (after every pending update), forward only: no gradient,
        no update, dropout off (Engine.eval_loss); every rank calls it with the same batch and gets the loss."""
        self._check_batch(x, y, passes=1)
        what = f"evaluation after step {self.step}"
        return self._reduce([self.engine.eval_loss(x, y, what)], torch.distributed.ReduceOp.SUM, what)[0]

    def _skip_on_overflow(self, overflow: bool) -> bool:
        """fp16: whether a gradient overflowed on any rank (then the step is skipped on every rank and the
        scale backs off)."""
        if self.scaler is None:
            return False
        self.scaler.update(overflow)
        return overflow

    def _check_batch(self, x: torch.Tensor, y: torch.Tensor, passes: int | None = None) -> None:
        if self._closed:
            raise PipelineError("train_batch on a closed Pipeline: make a new one")
        check_batch(self.plan, passes or self.accumulation_steps, x, y)

    def _reduce(self, values: list[float], op, what: str) -> list[float]:
        if self.info.world_size == 1:
            return values
        return self.engine.comm.reduce_values(values, op, what, self.engine.device.torch_device)

    @on_compute_stream
    def save_checkpoint(self, root, keep: int = 2) -> Path:
        """Every rank, at the same step: this step's checkpoint in root/step-N (mobiuspipe.checkpoint)."""
        return checkpoint.save_checkpoint(self, Path(root), keep)

    @on_compute_stream
    def load_checkpoint(self, folder) -> int:
        """Every rank: restore a checkpoint's states, scaler, random state and step; the step to go on at."""
        return checkpoint.load_checkpoint(self, Path(folder))

    def resume_at(self, step: int, scaler: dict | None = None) -> None:
        """Go on from a restored checkpoint: train_batch runs step `step` next, fp16's scaler as saved (None: kept)."""
        if step < 0:
            raise PipelineError(f"resume_at needs a step >= 0, not {step}")
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state(scaler)
        self.step = step

    def state_dict(self, frozen: bool = True) -> dict[str, torch.Tensor]:
        """This rank's weights (host copies, after every pending update), named as in
        nn.Sequential(*layers).state_dict(); the union over ranks is the whole model's. With `frozen` false,
        the trained weights alone (under LoRA: the adapters, not the frozen base)."""
        return {k: v for d in self.stage_state_dicts(frozen).values() for k, v in d.items()}

    @on_compute_stream
    def stage_state_dicts(self, frozen: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """state_dict() split by stage: {j: the weights of stage j} for this rank's stages."""
        out = {}
        for j, stage in self.stages.items():
            stage.wait_update()
            out[j] = stage.state_dict(frozen)
        return out

    def close(self, failed: bool = False) -> None:
        """Wait for the pending host updates, stop this rank's threads, leave the process group (if this Pipeline
        joined it; failed, as a `with` block left by an error: on NCCL aborted first, ranks.Membership). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if failed:
                self.group.abort()
            self.engine.finish(failed)
            if self.store is not None:
                self.store.close()  # flushes the index: the states on disk are the last step's
        finally:
            self.group.close(failed)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)
