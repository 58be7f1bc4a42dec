"""A stage's states all on SSD, its device-dtype weights and gradients streamed through staging buffers
(SsdStreamStates)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.weight_stream import BUFFERS, HostEmpty, SsdWeights
from mobiuspipe.optim.ooc_groups import BYTES_PER_ELEM
from mobiuspipe.runtime.states.ooc import ADAM_SLOTS, SsdTier, export_ooc, import_ooc, ooc_adam, settle_ooc

__all__ = ["SsdStreamStates"]


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
        self.optimizer = ooc_adam(flat, tier, prefix, adam_budget)
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
        self,
        src: torch.Tensor,
        device: Device,
        accumulate: bool = False,
        norm: bool = False,
        into: int = 0,
        finite: bool = False,
    ) -> CopyHandle:
        """Start writing the gradients to their SSD records (version `into`) through the staging buffers, off the
        compute thread (Device.stream_out: group by group, each copied off the device on the copy-out stream, then
        written; with norm noting their squared norm, with finite whether they are all finite, on the way);
        whoever reads them (the update, the norm, the overflow check, a tied exchange) waits for that.
        The job ends once its last writes are issued, so another stage's offload need not wait for them. Returns
        the copies off the device (src's slot is free once they have ended)."""
        before = self._offload

        def job(copy, copied) -> list:
            if before is not None:  # this stage's last offload (its job has ended: they run in order) and its writes
                _written(before)  # an error of it is this job's too
            writes = self.stream.save_grads(src, copy, finite, accumulate, norm, into, copied, wait=False)
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
            raise RuntimeError(
                "the gradients' finiteness is noted on their way to SSD when take_grads asks for it only"
            )
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
        settle_ooc(self.optimizer, keep, self._lr)
        if keep:
            self.stream.commit()

    def master_weights(self) -> torch.Tensor:
        return self.optimizer.read_state(("param",))["w"]["param"]

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        return export_ooc(self.optimizer, link_dir)

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        import_ooc(self.optimizer, tensors, extra, link_dir)
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
