"""A stage's device-dtype weights and its gradients kept in the SSD store, group by group, and moved through
a few group-sized staging buffers: no copy of the stage's size stays in host memory. SsdRecords is the read-only
part (the records a LOAD streams: a LoRA stage's frozen base too); SsdWeights adds the gradients and the update.

Records (dtype = the device's: bf16, fp16 or fp32), one per group of the stage's out-of-core Adam (group i
covers elements [i * G, i * G + n_i) of the stage's flat weights), each padded to 4 KiB for O_DIRECT:
  `{prefix}/w{i:06d}`  the weights the next LOAD copies to the device (written by the Adam update)
  `{prefix}/d{i:06d}`  the gradient OFFLOAD took off the device (read by the Adam update)
With two versions (the delayed update) each record has a second one, `...{i:06d}.v1`: a step's LOADs read one version
of the weights while the update of the step before writes the other from the other gradients.
LOAD reads the w records ahead into the buffers and copies each into its place in the arena slot; OFFLOAD
copies slices of the gradient slot into the buffers and writes the d records; the update (a GroupStream of
OutOfCoreAdam.step_streamed) reads d records one group ahead and writes w records behind itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mobiuspipe.memory.aio import ALIGN, round_up
from mobiuspipe.memory.reduce import all_finite, sum_of_squares
from mobiuspipe.memory.store.ssd_store import NEXT, SSDStore, StoreFuture, drain

__all__ = ["SsdRecords", "SsdWeights", "BUFFERS", "HostEmpty"]

HostEmpty = Callable[[int], torch.Tensor]
"""nbytes -> a uint8 host buffer aligned for O_DIRECT (the gpu's Device.host_empty: on CUDA page-locked at its own
size, kept until the Device closes)."""


BUFFERS = 4
"""Group-sized staging buffers per stage: reads ahead while loading; two for gradients and two for
weights while updating (with two versions, the update has four of its own)."""

Copy = Callable[[torch.Tensor, torch.Tensor], object]
"""copy(dst on the device, src in a staging buffer): returns once src may be reused."""

CopyOut = Callable[[torch.Tensor, torch.Tensor], object]
"""copy(dst a staging buffer, src on the device): returns once dst holds src."""


class SsdRecords:
    """A flat tensor kept in the store as w records of group_elems elements each, streamed into the device by
    load_into through BUFFERS staging buffers (see the module docstring)."""

    KINDS = ("w",)
    """The records kept per group, for the disk space checked up front."""

    def __init__(
        self,
        store: SSDStore,
        prefix: str,
        weights: torch.Tensor,
        group_elems: int,
        host_empty: HostEmpty,
        versions: int = 1,
    ):
        """Write `weights` (flat) as the w records (of every version); the staging buffers come from host_empty."""
        self.store, self.prefix, self.dtype, self.versions = store, prefix, weights.dtype, versions
        self._host_empty = host_empty
        numel = weights.numel()
        # no group for an empty flat (a LoRA stage without adapters: its optimizer's groups hold 0 elements)
        self.groups = [(a, min(group_elems, numel - a)) for a in range(0, numel, max(group_elems, 1))]
        per = ALIGN // self.dtype.itemsize
        self.record_elems = [round_up(n, per) for _, n in self.groups]
        size = max(self.record_elems, default=per) * self.dtype.itemsize
        self.buffers = self._staging(size, BUFFERS)
        self._record_bytes = size
        need = len(self.KINDS) * versions * size * len(self.groups)
        store.check_space(need, f"the records of {prefix}")
        self.rewrite(weights)

    def rewrite(self, weights: torch.Tensor, version: int | None = None) -> None:
        """Write `weights` (flat, the device dtype) as the w records again, of `version` (None: every version;
        resuming from a checkpoint)."""
        for v in range(self.versions) if version is None else (version,):
            self._put_all("w", lambda i, buf: buf.copy_(self._slice(weights, i)), v)

    def read(self, version: int = 0) -> torch.Tensor:
        """A host copy of the whole flat (every w record of `version`)."""
        out = torch.empty(sum(n for _, n in self.groups), dtype=self.dtype)
        self.load_into(out, lambda dst, src: dst.copy_(src), version)
        return out

    def load_into(self, dst: torch.Tensor, copy: Copy, version: int = 0) -> None:
        """Read every w record of `version`, in order and ahead, and copy each into its place in dst (flat)."""
        n, k = len(self.groups), len(self.buffers)
        reads = {i: self._get("w", i, i % k, version) for i in range(min(k, n))}
        try:
            for i in range(n):
                buf = reads.pop(i).result()
                copy(self._slice(dst, i), buf[: self.groups[i][1]])
                if i + k < n:
                    reads[i + k] = self._get("w", i + k, (i + k) % k, version)
        except BaseException:
            drain(reads.values())
            raise

    # -- records ----------------------------------------------------------------------------------------
    def _staging(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """count staging buffers of nbytes each, viewed as the records' dtype."""
        return [self._host_empty(nbytes).view(self.dtype) for _ in range(count)]

    def _key(self, kind: str, i: int, version: int = 0) -> str:
        return f"{self.prefix}/{kind}{i:06d}" + (f".v{version}" if version else "")

    def _slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        a, n = self.groups[i]
        return flat[a : a + n]

    def _get(
        self, kind: str, i: int, b: int, version: int = 0, buffers: list[torch.Tensor] | None = None
    ) -> StoreFuture[torch.Tensor]:
        """Start reading record i of `version` into buffer b (of `buffers`, default the stage's staging buffers)."""
        out = (self.buffers if buffers is None else buffers)[b][: self.record_elems[i]]
        return self.store.get_async(self._key(kind, i, version), out=out)

    def _put_all(
        self, kind: str, fill: Callable[[int, torch.Tensor], object], version: int = 0, wait: bool = True
    ) -> list[StoreFuture[None]]:
        """fill(i, buffer) then write it as record i of `version`, for every group, BUFFERS writes in flight. wait
        False: returns the writes still in flight, which whoever reads the records or refills the buffers waits for
        (else [])."""
        k, writes = len(self.buffers), {}
        try:
            for i in range(len(self.groups)):
                if (w := writes.pop(i - k, None)) is not None:
                    w.result()
                buf = self.buffers[i % k][: self.record_elems[i]]
                buf[self.groups[i][1] :].zero_()  # the padding: stored bytes are fully defined
                fill(i, buf[: self.groups[i][1]])
                writes[i] = self.store.put_async(self._key(kind, i, version), buf)
            if not wait:
                return list(writes.values())
            for w in writes.values():
                w.result()
            return []
        except BaseException:
            drain(writes.values())  # the buffers must be idle before anyone reuses them
            raise


class SsdWeights(SsdRecords):
    """The weights and gradients of one stage in the store (see the module docstring)."""

    KINDS = ("w", "d")

    def __init__(
        self,
        store: SSDStore,
        prefix: str,
        weights: torch.Tensor,
        group_elems: int,
        host_empty: HostEmpty,
        versions: int = 1,
    ):
        """Write the initial weights (flat, in the device dtype) as the stage's w records (of every version)."""
        super().__init__(store, prefix, weights, group_elems, host_empty, versions)
        self.grad_scale = 1.0
        self.finite: bool | None = None
        """Whether the last saved gradient was all finite; None when save_grads was not asked to check."""
        self.sumsq: float | None = None
        """The last saved gradient's squared L2 norm; None when save_grads was not asked for it."""
        self._incoming_buffer: torch.Tensor | None = None
        self._reads: dict[int, StoreFuture[torch.Tensor]] = {}
        self._writes: dict[int, StoreFuture[None]] = {}
        self._suffix = ""  # NEXT while a tentative update writes the w records beside the ones a load reads
        self._taken = 0  # the version of the d records save_grads wrote last
        self._grads, self._out = 0, 0  # the versions the update in progress reads (d) and writes (w)
        self._tentative_out: int | None = None  # the w version a tentative update wrote beside, until commit
        size = self.buffers[0].numel() * self.dtype.itemsize
        self._update_buffers = self.buffers if versions == 1 else self._staging(size, BUFFERS)
        """The update's staging buffers: with two versions its own, as it runs while the next step's LOADs and
        OFFLOADs use the others."""

    # -- OFFLOAD ------------------------------------------------------------------------------------
    def save_grads(
        self,
        src: torch.Tensor,
        copy: CopyOut,
        check_finite: bool,
        accumulate: bool = False,
        norm: bool = False,
        version: int = 0,
        copied: Callable[[], None] = lambda: None,
        wait: bool = True,
    ) -> list[StoreFuture[None]]:
        """Write src (the stage's flat gradient on the device, in the device dtype; copy moves each group's part off
        it) as the d records of `version`, or add it to them (accumulate: each record read, added to, written);
        copied() once the last part is off the device. On the way, with check_finite, note whether the result is
        all finite (fp16's overflow check, which then needs no second read; a pass the other dtypes do not pay),
        and with norm its squared L2 norm (self.sumsq, float64). wait False: returns the last writes, still in
        flight (_put_all), which must end before the records are read or the staging buffers refilled."""
        self.finite = True if check_finite else None
        self.sumsq = 0.0 if norm else None
        self._taken = version
        last = len(self.groups) - 1

        def fill(i: int, buf: torch.Tensor) -> None:
            part = self._slice(src, i)
            if accumulate:  # copied to the host first, then added there
                out = self.buffers[i % len(self.buffers)][: self.record_elems[i]]
                self.store.get(self._key("d", i, version), out=out)
                incoming = self._incoming()[: part.numel()]
                copy(incoming, part)
                buf.add_(incoming)
            else:
                copy(buf, part)
            if i == last:
                copied()
            if self.finite is not None:
                self.finite = self.finite and all_finite(buf)
            if self.sumsq is not None:
                self.sumsq += sum_of_squares(buf)

        return self._put_all("d", fill, version, wait)

    def make_accumulation_buffer(self) -> None:
        """Make the buffer an accumulated pass's gradient comes into now (not mid-step, at its first use)."""
        self._incoming()

    def _incoming(self) -> torch.Tensor:
        """A host buffer of one record for a device gradient on its way to be added (made at first use)."""
        if self._incoming_buffer is None:
            self._incoming_buffer = self._staging(self._record_bytes, 1)[0]
        return self._incoming_buffer

    def read_grads(self, offset: int, n: int) -> torch.Tensor:
        """A copy of elements offset .. offset + n of the saved gradient (between OFFLOAD and the update)."""
        out = torch.empty(n, dtype=self.dtype)
        for i, lo, hi in self._overlaps(offset, n):
            a = self.groups[i][0]
            out[lo - offset : hi - offset] = self._get("d", i, 0, self._taken).result()[lo - a : hi - a]
        return out

    def add_grads(self, offset: int, t: torch.Tensor) -> None:
        """Add t into elements offset .. offset + len(t) of the saved gradient (read, add, write each group it
        touches; the finiteness note, if kept, covers the sums)."""
        for i, lo, hi in self._overlaps(offset, t.numel()):
            a = self.groups[i][0]
            buf = self._get("d", i, 0, self._taken).result()
            part = buf[lo - a : hi - a]
            part.add_(t[lo - offset : hi - offset])
            if self.finite is not None:
                self.finite = self.finite and all_finite(part)
            self.store.put(self._key("d", i, self._taken), buf)

    def _overlaps(self, offset: int, n: int) -> list[tuple[int, int, int]]:
        """(group i, lo, hi) for each group overlapping elements [offset, offset + n): [lo, hi) is the overlap."""
        return [
            (i, max(a, offset), min(a + m, offset + n))
            for i, (a, m) in enumerate(self.groups)
            if a < offset + n and offset < a + m
        ]

    # -- the GroupStream of the Adam update -----------------------------------------------------------
    def grad(self, i: int) -> torch.Tensor:
        """Group i's gradient (divided by grad_scale, in fp32, when it is not 1); reads group i + 1 ahead."""
        if i == 0:
            self._reads = {0: self._get("d", 0, 0, self._grads, self._update_buffers)}
        buf = self._reads.pop(i).result()[: self.groups[i][1]]
        if i + 1 < len(self.groups):  # its buffer held group i - 1's gradient, whose update has ended
            self._reads[i + 1] = self._get("d", i + 1, (i + 1) % 2, self._grads, self._update_buffers)
        return buf if self.grad_scale == 1.0 else buf.float().mul_(1.0 / self.grad_scale)

    def out(self, i: int) -> torch.Tensor:
        """Where group i's updated weights go: a buffer whose write of group i - 2 has ended."""
        if (w := self._writes.pop(i - 2, None)) is not None:
            w.result()
        return self._update_buffers[2 + i % 2][: self.record_elems[i]]

    def written(self, i: int) -> None:
        key = self._key("w", i, self._out) + self._suffix
        self._writes[i] = self.store.put_async(key, self._update_buffers[2 + i % 2][: self.record_elems[i]])

    def start_update(self, tentative: bool, grads: int = 0, out: int = 0) -> None:
        """Before an update from the d records of version `grads` into the w records of version `out`: a tentative
        one writes its weights beside those (commit() swaps them in)."""
        if tentative and self._key("w", 0, out) + NEXT not in self.store:
            need = sum(self.record_elems) * self.dtype.itemsize
            self.store.check_space(need, f"the second set of weight records of {self.prefix!r} (speculative updates)")
        self._suffix = NEXT if tentative else ""
        self._grads, self._out = grads, out
        self._tentative_out = out if tentative else None

    def commit(self) -> None:
        """Make the weights the tentative update wrote the w records (their entries exchange names)."""
        out, self._tentative_out = self._tentative_out, None
        if out is None:
            raise RuntimeError(f"{self.prefix}: commit without a tentative update")
        for i in range(len(self.groups)):
            self.store.swap(self._key("w", i, out), self._key("w", i, out) + NEXT)

    def end_update(self, failed: bool) -> None:
        """Let every read and write of the update end: raising the first error, or after a failed update
        dropping theirs (that failure is already on its way up)."""
        pending = [*self._reads.values(), *self._writes.values()]
        self._reads, self._writes, self._suffix = {}, {}, ""
        if failed:
            drain(pending)
            return
        for f in pending:
            f.result()
