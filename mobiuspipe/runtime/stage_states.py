"""Where a stage's states live: all in host memory (HostStates: an optimizer over a flat fp32 parameter);
the fp32 master and moments in the rank's SSD store (SsdStates: OutOfCoreAdam through a fixed host budget);
or those and the device-dtype weights and gradients too (SsdStreamStates). Each loads the weights into the
arena, takes the offloaded gradients, steps, and writes the next device weights (bf16/fp16, or fp32) in
the same pass; all give the same bits (the same AdamW kernel, elementwise). Or all on the gpu (DeviceStates, in
mobiuspipe.runtime.device_states: LoRA's adapters). A stage's frozen weights are mobiuspipe.runtime.frozen's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mobiuspipe.memory.aio import ALIGN
from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.reduce import all_finite, sum_of_squares
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.weight_stream import BUFFERS, HostEmpty, SsdWeights
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam
from mobiuspipe.optim.ooc_groups import BYTES_PER_ELEM, ELEM_ALIGN, least_budget_bytes
from mobiuspipe.optim.ooc_links import adopt_records, link_records
from mobiuspipe.optim.undo import StepUndo
from mobiuspipe.runtime.device_states import DeviceStates
from mobiuspipe.standin.places import plain

ADAM_SLOTS = 4
"""Group slots of each stage's out-of-core Adam (read ahead, update, write back, one spare)."""


def least_share(dtype_bytes: int) -> int:
    """The least host budget of a stage on SSD: the out-of-core Adam's slots of one 4 KiB-aligned group each,
    and the weight stream's staging buffers of one group (a group of 1024 elements of dtype_bytes <= 4 fits
    one 4 KiB page)."""
    return least_budget_bytes(ADAM_SLOTS) + BUFFERS * ALIGN * max(1, -(-ELEM_ALIGN * dtype_bytes // ALIGN))


__all__ = [
    "least_share",
    "HostStates",
    "SsdStates",
    "SsdStreamStates",
    "StageStates",
    "SsdTier",
]


@dataclass(frozen=True)
class SsdTier:
    """One rank's store and the host memory each of its stages on SSD may use."""

    store: SSDStore
    host_budget_bytes: int
    hyper: AdamHyper


class HostStates:
    """The master weights as one flat fp32 parameter in host memory (pinned on CUDA), stepped by the
    optimizer the factory makes; the fp32 master is itself what fp32 training loads (one version). The device-dtype
    weights (bf16/fp16) and the offloaded gradients are host tensors too.

    versions 2 (the delayed update, train.delayed_update): the weights the device loads and the offloaded gradients
    are kept twice, so that a step's loads read one version of the weights while the update of the step before
    writes the other from the other gradients (mobiuspipe.runtime.stage.Stage picks them); in fp32 the loaded
    versions are then copies of the master, which that update changes in place."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype, pin, make_optimizer, versions: int = 1):
        self._pin, self._incoming = pin, None
        self._taking: tuple[CopyHandle, bool, bool, int] | None = None  # in flight: copy, accumulate, norm, into
        self._settling = threading.Lock()
        self.loads_master = dtype == torch.float32 and versions == 1
        """fp32 training: the device loads the master itself and master.grad is the offloaded gradient buffer."""
        self.master = nn.Parameter(pin(flat) if self.loads_master else flat)  # pinned only where copies read it
        first = self.master.data if self.loads_master else pin(flat.to(dtype, copy=True))
        self._weights = [first] + [pin(flat.to(dtype, copy=True)) for _ in range(versions - 1)]
        self._grads = [pin(torch.zeros(flat.numel(), dtype=dtype)) for _ in range(versions)]
        self._taken = 0
        """The gradient buffer take_grads filled last (what the norm, the overflow check and a tied exchange read)."""
        self.sumsq: float | None = None
        """The squared L2 norm of the gradients take_grads last took, when asked for it (read: grad_sumsq)."""
        if self.loads_master:
            self.master.grad = self._grads[0]
        self.optimizer = make_optimizer([self.master])
        self._undo = StepUndo()

    @property
    def weights(self) -> torch.Tensor:
        """The device-dtype weights of version 0 (the only one without the delayed update)."""
        return self._weights[0]

    @property
    def grads(self) -> torch.Tensor:
        """The gradients take_grads took last."""
        return self._grads[self._taken]

    def version(self, i: int) -> torch.Tensor:
        """Version i of the weights the device loads (a checkpoint saves the one a delayed step reads)."""
        return self._weights[i]

    def set_version(self, i: int, weights: torch.Tensor) -> None:
        """Copy `weights` into version i of the weights the device loads (a resumed delayed run's lagging weights)."""
        self._weights[i].copy_(weights)

    def load_into(
        self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = (), version: int = 0
    ) -> CopyHandle:
        """Start copying the weights the device computes with (their `version`) into dst (its arena slot, flat),
        after `after`: every user of dst (its slot's release mark and the copies that still read it)."""
        return device.copy_in(dst, self._weights[version], after, computed=False)

    def take_grads(
        self, src: torch.Tensor, device: Device, accumulate: bool = False, norm: bool = False, into: int = 0
    ) -> CopyHandle:
        """Start copying the stage's accumulated gradients (flat, device dtype) off the device on the copy-out
        stream, into gradient buffer `into` (or, accumulate: into a buffer that _settle adds to the ones taken
        before); with norm, _settle notes the squared L2 norm of the result (float64). Nothing here blocks the compute
        thread: whoever reads the gradients (the update, the overflow check, the norm, a tied exchange) settles
        them first. Returns the copy (the slot src lies in is free once it has ended)."""
        self._settle()  # the previous pass's gradients are in before this pass's are added to them
        copy = device.copy_out(self._incoming_buffer() if accumulate else self._grads[into], src)
        self._taking = (copy, accumulate, norm, into)
        self._taken = into
        return copy

    def _settle(self, only: int | None = None) -> None:
        """Wait for the offload in flight (if any; only: if it fills gradient buffer `only`) and finish it on the host:
        the add of an accumulated pass, the norm."""
        with self._settling:
            if self._taking is None or only not in (None, self._taking[3]):
                return
            copy, accumulate, norm, into = self._taking
            copy.synchronize()
            if accumulate:
                self._grads[into].add_(self._incoming_buffer())
            self.sumsq = sum_of_squares(self._grads[into]) if norm else None
            self._taking = None

    def make_accumulation_buffer(self) -> None:
        """Make the buffer an accumulated pass's gradients come into now (on CUDA page-locked: not mid-step)."""
        self._incoming_buffer()

    def _incoming_buffer(self) -> torch.Tensor:
        """A host buffer like the gradients, for an accumulated pass on its way."""
        if self._incoming is None:
            self._incoming = self._pin(torch.empty_like(self._grads[0]))
        return self._incoming

    def grad_sumsq(self) -> float:
        """The squared L2 norm of the last offloaded gradients (0.0 when take_grads was not asked for it)."""
        self._settle()
        return self.sumsq or 0.0

    def grads_finite(self) -> bool:
        self._settle()
        return all_finite(self.grads)

    grads_on_gpu = False
    """Whether grad_slice gives, and add_grads takes, gpu memory (DeviceStates) rather than host memory."""

    def grad_slice(self, offset: int, n: int) -> torch.Tensor:
        """A copy of elements offset .. offset + n of the offloaded gradients (device dtype, host memory)."""
        self._settle()
        return self.grads[offset : offset + n].clone()

    def add_grads(self, offset: int, t: torch.Tensor) -> None:
        """Add t (host memory) into the offloaded gradients from element offset on (a tied parameter's other half)."""
        self._settle()
        self.grads[offset : offset + t.numel()].add_(t)

    speculates = True
    """Whether step(tentative=True) and settle_tentative work here (a speculative update: Pipeline's)."""

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """One update from gradient buffer `grads` divided by grad_scale, at lr (None: the optimizer's own), the next
        weights written into version `out`. tentative: keep what it overwrites until settle_tentative (the
        gradients are never written: the norm and the overflow check may read them meanwhile). It waits for the
        offload into buffer `grads` only (the delayed update's next one, into the other, may be in flight)."""
        self._settle(grads)
        if tentative:
            self._undo.save(self.optimizer, self.master, () if self.loads_master else (self._weights[out],))
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        g, weights = self._grads[grads], self._weights[out]
        if g.dtype == torch.float32:  # fp32: the update reads master.grad, the buffer itself
            if grad_scale != 1.0:
                g = g.mul(1.0 / grad_scale) if tentative else g.mul_(1.0 / grad_scale)
            self.master.grad = g
            self.optimizer.step()
            if not self.loads_master:
                weights.copy_(self.master.data)
            return
        grad = g if grad_scale == 1.0 else g.float().mul_(1.0 / grad_scale)
        step_fused = getattr(self.optimizer, "step_fused", None)
        if step_fused is not None:
            step_fused({self.master: weights}, grads={self.master: grad})
            return
        self.master.grad = grad.float()
        self.optimizer.step()
        weights.copy_(self.master.data)

    def settle_tentative(self, keep: bool) -> None:
        """The step(tentative=True) before was right (keep) or is undone: every state and weight bit as before it."""
        if keep:
            self._undo.drop()
        else:
            self._undo.restore()

    def master_weights(self) -> torch.Tensor:
        return plain(self.master.data)

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """A copy of what the next step depends on: {"master": fp32 flat, "opt/KEY": the optimizer's state
        tensors (AdamW: step, exp_avg, exp_avg_sq)} and the optimizer's param_groups (hyper-parameters).
        States on SSD are hard-linked into link_dir instead where it can (see SsdStates)."""
        sd = self.optimizer.state_dict()
        own = sd["state"].get(0, {})
        tensors = {"master": self.master.data.clone()}
        tensors.update({f"opt/{k}": _tensor(v).clone() for k, v in own.items()})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return tensors, {"param_groups": groups}

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        """Set the states export_state gave (the device-dtype weights follow from the master); link_dir: where
        export_state linked the files of states on SSD."""
        self.master.data.copy_(tensors["master"])
        if not self.loads_master:
            for w in self._weights:
                w.copy_(self.master.data)
        state = {k[4:]: v for k, v in tensors.items() if k.startswith("opt/")}
        sd = self.optimizer.state_dict()
        groups = extra.get("param_groups") or [
            {k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]
        ]
        for group, now in zip(groups, sd["param_groups"]):
            group["params"] = now["params"]
        self.optimizer.load_state_dict({"state": {0: state} if state else {}, "param_groups": groups})


def _tensor(v) -> torch.Tensor:
    """An optimizer state value as a tensor (torch keeps AdamW's step as a tensor; some keep a number)."""
    return v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)


def _settle_ooc(opt: OutOfCoreAdam, keep: bool, lr_before: float) -> None:
    """Keep an out-of-core Adam's tentative step, or roll it back with the learning rate it had before it."""
    if keep:
        opt.commit()
    else:
        opt.roll_back()
        opt.lr = lr_before


def _export_ooc(opt: OutOfCoreAdam, link_dir: Path | None) -> tuple[dict[str, torch.Tensor], dict]:
    """An out-of-core AdamW's states in export_state's form: its records hard-linked into link_dir (no bytes
    copied; copied file by file where link_dir's filesystem cannot link them), or without link_dir read from the
    store (fp32 flat)."""
    if link_dir is not None:
        return {}, {"records": link_records(opt, link_dir)}
    state = opt.read_state()["w"]
    tensors = {"master": state["param"], "opt/exp_avg": state["exp_avg"], "opt/exp_avg_sq": state["exp_avg_sq"]}
    tensors["opt/step"] = torch.tensor(float(opt.step_count), dtype=torch.float32)
    return tensors, {}


def _import_ooc(opt: OutOfCoreAdam, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None) -> None:
    """Set an out-of-core AdamW's records and step count from export_state's form."""
    if "records" in extra:
        if link_dir is None:
            raise ValueError("the states were linked into a checkpoint folder: pass it to import_state")
        adopt_records(opt, link_dir, extra["records"])
        return
    m = tensors["master"]
    moments = {k: tensors.get(f"opt/{k}", torch.zeros_like(m)) for k in ("exp_avg", "exp_avg_sq")}
    step = int(tensors["opt/step"].item()) if "opt/step" in tensors else 0
    opt.write_state({"w": {"param": m, **moments}}, step)


class SsdStates(HostStates):
    """The master weights and both moments in the rank's SSD store (records `{prefix}/g...`), stepped by
    OutOfCoreAdam through the tier's host budget; the device-dtype weights and gradients stay in memory."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype, pin, tier: SsdTier, prefix: str, versions: int = 1):
        self._pin, self._incoming = pin, None
        self._taking, self._settling = None, threading.Lock()
        self.loads_master = False
        self._weights = [pin(flat.to(dtype, copy=True)) for _ in range(versions)]
        self._grads = [pin(torch.zeros(flat.numel(), dtype=dtype)) for _ in range(versions)]
        self._taken = 0
        self.sumsq: float | None = None
        self.optimizer = _ooc_adam(flat, tier, prefix, tier.host_budget_bytes)
        self._undo = StepUndo()
        self._lr = self.optimizer.lr  # before a tentative step

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """HostStates.step; tentative: the out-of-core Adam writes its states beside the ones it read (a second set
        of records on the SSD) and the weights it overwrites are kept in memory, until settle_tentative."""
        self._settle(grads)
        self._lr = self.optimizer.lr
        if tentative:
            self._undo.save(None, None, (self._weights[out],))
        if lr is not None:
            self.optimizer.lr = lr
        g = self._grads[grads]
        grad = g if grad_scale == 1.0 else g.float().mul_(1.0 / grad_scale)
        self.optimizer.step({"w": grad}, {"w": self._weights[out]}, tentative=tentative)

    def settle_tentative(self, keep: bool) -> None:
        _settle_ooc(self.optimizer, keep, self._lr)
        if keep:
            self._undo.drop()
        else:
            self._undo.restore()

    def master_weights(self) -> torch.Tensor:
        return self.optimizer.read_state(("param",))["w"]["param"]

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        return _export_ooc(self.optimizer, link_dir)

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        _import_ooc(self.optimizer, tensors, extra, link_dir)
        master = self.master_weights()
        for w in self._weights:
            w.copy_(master)


class SsdStreamStates:
    """Everything on SSD: the optimizer states as in SsdStates, and the device-dtype weights and gradients
    as records too (SsdWeights), streamed through staging buffers carved from the stage's budget."""

    def __init__(
        self,
        flat: torch.Tensor,
        dtype: torch.dtype,
        tier: SsdTier,
        prefix: str,
        host_empty: HostEmpty,
        versions: int = 1,
    ):
        """host_empty makes the stream's staging buffers (the gpu's Device.host_empty)."""
        adam = ADAM_SLOTS * BYTES_PER_ELEM  # host bytes per group element: the Adam's slots, then the buffers
        adam_budget = tier.host_budget_bytes * adam // (adam + versions * BUFFERS * dtype.itemsize)  # 2: the update's
        self.optimizer = _ooc_adam(flat, tier, prefix, adam_budget)
        groups = self.optimizer.group_elems
        self.stream = SsdWeights(tier.store, f"{prefix}/lowp", flat.to(dtype), groups, host_empty, versions)
        self.sumsq: float | None = None
        self._lr = self.optimizer.lr  # before a tentative step
        self._offload: Future | None = None
        """The last gradient offload (Device.stream_out's job, of the writes it left in flight): what reads the d
        records or the staging buffers waits for it and its writes (_settle)."""
        self._offloads: dict[int, Future] = {}
        """The last offload into each version of the d records (the update waits for its own version's only)."""

    def load_into(
        self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = (), version: int = 0
    ) -> CopyHandle:
        """As HostStates.load_into, streamed from the w records; after the offload in flight, which uses the same
        staging buffers (waited for off the compute thread)."""

        def job(copy) -> None:
            self._settle()
            self.stream.load_into(dst, copy, version)

        return device.stream_in(job, after, computed=False)

    def take_grads(
        self, src: torch.Tensor, device: Device, accumulate: bool = False, norm: bool = False, into: int = 0
    ) -> CopyHandle:
        """Start writing the gradients to their SSD records (version `into`) through the staging buffers, off the
        compute thread (Device.stream_out: group by group, each copied off the device on the copy-out stream, then
        written); whoever reads them (the update, the norm, the overflow check, a tied exchange) waits for that.
        The job ends once its last writes are issued, so another stage's offload need not wait for them. Returns
        the copies off the device (src's slot is free once they have ended)."""
        fp16 = src.dtype == torch.float16  # only fp16 asks grads_finite
        before = self._offload

        def job(copy, copied) -> list:
            if before is not None:  # this stage's last offload (its job has ended: they run in order) and its writes
                _written(before)  # an error of it is this job's too
            writes = self.stream.save_grads(src, copy, fp16, accumulate, norm, into, copied, wait=False)
            self.sumsq = self.stream.sumsq
            return writes

        copies, self._offload = device.stream_out(job)
        self._offloads[into] = self._offload
        return copies

    def make_accumulation_buffer(self) -> None:
        """HostStates.make_accumulation_buffer: the stream's record-sized buffer."""
        self.stream.make_accumulation_buffer()

    def _settle(self, version: int | None = None) -> None:
        """Wait for the gradient offload in flight and its writes, if any (raising its error); version: the last
        offload into that version of the d records (the update's own staging buffers leave the others to run on)."""
        offload = self._offload if version is None else self._offloads.get(version)
        if offload is not None:
            _written(offload)

    def grad_sumsq(self) -> float:
        self._settle()
        return self.sumsq or 0.0

    def grads_finite(self) -> bool:
        self._settle()
        if self.stream.finite is None:
            raise RuntimeError("the gradient's finiteness is checked on the way to SSD in fp16 training only")
        return self.stream.finite

    grads_on_gpu = False

    def grad_slice(self, offset: int, n: int) -> torch.Tensor:
        self._settle()
        return self.stream.read_grads(offset, n)

    def add_grads(self, offset: int, t: torch.Tensor) -> None:
        self._settle()
        self.stream.add_grads(offset, t)

    speculates = True

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """HostStates.step, streamed; tentative: the optimizer states and the weights are written beside the records
        they replace once settle_tentative keeps them (no byte more is read or written). It waits for the offload into
        version `grads` only (with two versions the update has staging buffers of its own; with one, that is the
        last offload)."""
        self._settle(grads)
        self._lr = self.optimizer.lr
        if lr is not None:
            self.optimizer.lr = lr
        self.stream.grad_scale = grad_scale
        self.stream.start_update(tentative, grads, out)
        try:
            self.optimizer.step_streamed(self.stream, tentative=tentative)
        except BaseException:
            self.stream.end_update(failed=True)
            raise
        self.stream.end_update(failed=False)

    def settle_tentative(self, keep: bool) -> None:
        _settle_ooc(self.optimizer, keep, self._lr)
        if keep:
            self.stream.commit()

    def master_weights(self) -> torch.Tensor:
        return self.optimizer.read_state(("param",))["w"]["param"]

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        return _export_ooc(self.optimizer, link_dir)

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        _import_ooc(self.optimizer, tensors, extra, link_dir)
        self._settle()
        self.stream.rewrite(self.master_weights().to(self.stream.dtype))

    def version(self, i: int) -> torch.Tensor:
        """A host copy of version i of the weights the device loads (read from its records)."""
        self._settle()
        return self.stream.read(i)

    def set_version(self, i: int, weights: torch.Tensor) -> None:
        """Write `weights` as version i of the weights the device loads (a resumed delayed run's lagging weights)."""
        self._settle()
        self.stream.rewrite(weights, i)


def _written(offload: Future) -> None:
    """Wait for an SSD offload's job and the writes it left in flight."""
    for write in offload.result():
        write.result()


StageStates = HostStates | DeviceStates | SsdStates | SsdStreamStates


def _ooc_adam(flat: torch.Tensor, tier: SsdTier, prefix: str, budget: int) -> OutOfCoreAdam:
    h = tier.hyper
    return OutOfCoreAdam.create(
        tier.store,
        {"w": flat},
        lr=h.lr,
        betas=h.betas,
        eps=h.eps,
        weight_decay=h.weight_decay,
        host_budget_bytes=budget,
        slots=ADAM_SLOTS,
        prefix=prefix,
    )
