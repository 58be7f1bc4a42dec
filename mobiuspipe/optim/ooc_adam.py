"""Out-of-core AdamW: fp32 master weights and both moments live in an SSDStore and stream group by group
through a fixed host-memory budget, reads, updates and write-backs pipelined as in Fuyou (section 4.3).

Layout. The parameters are laid end to end in one flat fp32 space of N elements, cut into groups of G
elements (G a multiple of 1024, so every section stays 4 KiB-aligned for O_DIRECT); the last group is
padded with zeros, which stay zero. Group i is one stored record `{prefix}/g{i:06d}` of 3 * G_i fp32
values: [ master weights | exp_avg | exp_avg_sq ], 12 bytes per element.

Pipeline. The host budget holds K slots of 12 * G bytes; group i uses slot i mod K. While group i is
updated, the reads of groups i+1 .. i+K-2 and the write-back of group i-1 are in flight; the read of
group i+K-1 goes into group i-1's slot once its write-back ends (the delayed write-back of Fuyou). The
update is elementwise, so the result equals an in-memory AdamW step bit for bit (same kernel).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from foundation.units import fmt_bytes
from mobiuspipe.memory.aio import aligned_empty, round_up
from mobiuspipe.memory.store.ssd_store import NEXT, SSDStore, StoreFuture, drain
from mobiuspipe.optim.cpu_adam import adamw_update, check_adamw_args
from mobiuspipe.optim.ooc_groups import (
    BYTES_PER_ELEM,
    ELEM_ALIGN,
    Segment,
    group_elems_for,
    least_budget_bytes,
    plan_groups,
    section_elems,
)

__all__ = ["OutOfCoreAdam", "GroupStream", "plan_groups", "least_budget_bytes"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_PARTS = ("param", "exp_avg", "exp_avg_sq")
"""The sections of a record, in order: fp32 master weights and AdamW's two moments."""


class GroupStream(Protocol):
    """Where step_streamed takes each group's gradient and puts its updated weights."""

    def grad(self, i: int) -> torch.Tensor: ...

    def out(self, i: int) -> torch.Tensor: ...

    def written(self, i: int) -> None: ...


class OutOfCoreAdam:
    """AdamW (torch.optim.AdamW semantics, one step count for all parameters) over SSD-resident states.

    Make one with create() (from initial weights) or open() (resume what a store holds). step() takes
    every parameter's gradient (fp32, bf16 or fp16, any shape with the parameter's element count) and
    optionally bf16/fp16 tensors to receive the updated weights in the same pass.
    """

    def __init__(self, store: SSDStore, meta: dict, slots: int, impl: str, simd: str):
        self.store = store
        self.prefix = meta["prefix"]
        self.names: list[str] = meta["names"]
        self.shapes: dict[str, list[int]] = dict(zip(self.names, meta["shapes"]))
        self.numels = {n: math.prod(s) for n, s in self.shapes.items()}
        self.group_elems: int = meta["group_elems"]
        self.step_count: int = meta["step"]
        self.lr, self.betas, self.eps, self.weight_decay = (
            meta["lr"],
            tuple(meta["betas"]),
            meta["eps"],
            meta["weight_decay"],
        )
        self.impl, self.simd = impl, simd
        self.groups = plan_groups([(n, self.numels[n]) for n in self.names], self.group_elems)
        # elements per section of each group's record: the group's size, padded to ELEM_ALIGN
        self.section_elems = [section_elems(g) for g in self.groups]
        self.slots = [
            aligned_empty(BYTES_PER_ELEM * self.group_elems).view(torch.float32)  # pageable: no gpu copies them
            for _ in range(min(slots, max(len(self.groups), 1)))
        ]
        self.io_note = store.engine.register(self.slots)  # "" when the slots are io_uring fixed buffers
        self.broken = ""  # why the states on disk are inconsistent (a step failed halfway), or ""
        self.pending = False
        """A tentative step's states lie in the second set of records, not yet committed or rolled back."""
        self._writing = ""  # the suffix of the records a step writes: NEXT for a tentative step

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        store: SSDStore,
        params: dict[str, torch.Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        host_budget_bytes: int = 256 << 20,
        slots: int = 4,
        prefix: str = "adam",
        impl: str = "auto",
        simd: str = "auto",
    ) -> OutOfCoreAdam:
        """Write the initial master weights (zero moments) of params {name: tensor} into store."""
        if not params:
            raise ValueError("OutOfCoreAdam.create needs at least one parameter")
        check_adamw_args(lr, betas, eps, weight_decay)
        if prefix in store.meta:
            raise ValueError(
                f"the store {store.folder} already holds an optimizer under {prefix!r}: resume it "
                "with OutOfCoreAdam.open(), or pick another prefix"
            )
        total = sum(p.numel() for p in params.values())
        group_elems = min(group_elems_for(host_budget_bytes, slots), round_up(total, ELEM_ALIGN))
        meta = dict(
            prefix=prefix,
            names=list(params),
            shapes=[list(p.shape) for p in params.values()],
            group_elems=group_elems,
            step=0,
            lr=lr,
            betas=list(betas),
            eps=eps,
            weight_decay=weight_decay,
        )
        opt = cls(store, meta, slots, impl, simd)
        need = BYTES_PER_ELEM * sum(opt.section_elems)
        store.check_space(need, f"the optimizer states of {len(params)} parameters")
        opt._write_initial(params)
        store.meta[prefix] = meta
        return opt

    @classmethod
    def open(
        cls,
        store: SSDStore,
        *,
        host_budget_bytes: int = 256 << 20,
        slots: int = 4,
        prefix: str = "adam",
        impl: str = "auto",
        simd: str = "auto",
    ) -> OutOfCoreAdam:
        """Resume the optimizer a store holds (saved by flush()); hyper-parameters come with it."""
        meta = store.meta.get(prefix)
        if meta is None:
            raise KeyError(
                f"the store {store.folder} holds no optimizer under {prefix!r} (it has "
                f"{sorted(store.meta)}); create one with OutOfCoreAdam.create()"
            )
        if meta.get("broken"):
            raise RuntimeError(meta["broken"])
        budget = BYTES_PER_ELEM * meta["group_elems"] * slots
        if budget > host_budget_bytes:
            raise ValueError(
                f"the stored groups of {meta['group_elems']} elements need {fmt_bytes(budget)} "
                f"for {slots} slots, over host_budget_bytes {fmt_bytes(host_budget_bytes)}: "
                "raise the budget or use fewer slots (at least 3)"
            )
        return cls(store, meta, slots, impl, simd)

    def _key(self, i: int, suffix: str = "") -> str:
        return f"{self.prefix}/g{i:06d}{suffix}"

    def _sections(self, i: int, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group i's record in a slot and its three sections (weights, exp_avg, exp_avg_sq)."""
        n = self.section_elems[i]
        rec = slot[: 3 * n]
        return rec, rec[:n], rec[n : 2 * n], rec[2 * n :]

    def _write_initial(self, params: dict[str, torch.Tensor]) -> None:
        flat = {n: p.detach().reshape(-1) for n, p in params.items()}
        pending: list[StoreFuture[None]] = []
        for i, segs in enumerate(self.groups):
            slot = self.slots[i % len(self.slots)]
            if len(pending) >= len(self.slots):
                pending.pop(0).result()
            rec, p, _, _ = self._sections(i, slot)
            rec.zero_()
            for s in segs:
                p[s.group_off : s.group_off + s.numel].copy_(flat[s.name][s.param_off : s.param_off + s.numel])
            pending.append(self.store.put_async(self._key(i), rec))
        for f in pending:
            f.result()

    # ------------------------------------------------------------------ the step
    def step(
        self,
        grads: dict[str, torch.Tensor],
        low_precision_out: dict[str, torch.Tensor] | None = None,
        *,
        pipelined: bool = True,
        tentative: bool = False,
    ) -> None:
        """One AdamW step of every parameter from grads {name: gradient}; each tensor of
        low_precision_out {name: bf16/fp16/fp32 tensor} receives that parameter's updated weights.
        pipelined=False runs read, update and write-back of each group one after the other. tentative: the
        updated states go to a second set of records (made at the first such step), the ones read stay as they
        were, until commit() makes the step's states the optimizer's or roll_back() forgets it."""
        g_flat = self._check_grads(grads)
        o_flat = self._check_outputs(low_precision_out or {})
        self._run_step(lambda i, slot: self._update(i, slot, g_flat, o_flat), pipelined, tentative)

    def commit(self) -> None:
        """Make the tentative step's states the optimizer's (the records exchange names: no byte moves)."""
        self._check_pending("commit")
        for i in range(len(self.groups)):
            self.store.swap(self._key(i), self._key(i, NEXT))
        self.pending = False

    def roll_back(self) -> None:
        """Forget the tentative step: the states and the step count are as before it, bit for bit."""
        self._check_pending("roll_back")
        self.step_count -= 1
        self.pending = False
        self._save_meta()

    def _check_pending(self, what: str) -> None:
        if not self.pending:
            raise RuntimeError(f"OutOfCoreAdam.{what}: no tentative step is pending (step(tentative=True) first)")

    def _check_next_space(self) -> None:
        """The first tentative step's second set of records fits the store's disk (ENOSPC names what needs it)."""
        if self._key(0, NEXT) not in self.store:
            need = BYTES_PER_ELEM * sum(self.section_elems)
            self.store.check_space(
                need, f"the second set of optimizer records of {self.prefix!r} (speculative updates)"
            )

    def step_streamed(self, stream: GroupStream, *, pipelined: bool = True, tentative: bool = False) -> None:
        """One AdamW step of a one-parameter optimizer whose gradient and updated weights do not fit in
        memory either: group i takes stream.grad(i) and writes into stream.out(i) (both group-sized, in
        the stream's dtypes), then stream.written(i) is called; groups come in order. tentative: as step's."""
        if len(self.names) != 1:
            raise ValueError(f"step_streamed needs an optimizer of one (flat) parameter, not {len(self.names)}")

        def update(i: int, slot: torch.Tensor) -> None:
            (seg,) = self.groups[i]  # one parameter: one segment per group, at its start
            self._kernel(i, slot, seg, stream.grad(i)[: seg.numel], stream.out(i)[: seg.numel])
            stream.written(i)

        self._run_step(update, pipelined, tentative)

    def _run_step(self, update, pipelined: bool, tentative: bool = False) -> None:
        """Count the step, run update(i, slot) over every group, and mark the states broken if it fails (a tentative
        step's failure leaves them as they were)."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.pending:
            raise RuntimeError("OutOfCoreAdam: the tentative step before is not settled: commit() or roll_back() it")
        if tentative:
            self._check_next_space()
        self.step_count += 1
        run = self._run_pipelined if pipelined else self._run_serial
        self._writing = NEXT if tentative else ""
        try:
            run(update)
        except BaseException as exc:
            if tentative:
                self.step_count -= 1  # the records it read are untouched
                raise
            self.broken = (
                f"step {self.step_count} of the out-of-core optimizer in {self.store.folder} failed "
                f"({type(exc).__name__}: {exc}); some groups on disk took the step and others did "
                "not: restore the folder from a copy taken after a flush, or create the optimizer "
                "anew"
            )
            self.store.meta[self.prefix]["broken"] = self.broken  # open() refuses it, even after a restart
            raise
        finally:
            self._writing = ""
        self.pending = tentative
        self._save_meta()

    def _update(self, i: int, slot: torch.Tensor, grads: dict, outs: dict) -> None:
        for s in self.groups[i]:
            o = outs.get(s.name)
            g = grads[s.name][s.param_off : s.param_off + s.numel]
            self._kernel(i, slot, s, g, None if o is None else o[s.param_off : s.param_off + s.numel])

    def _kernel(self, i: int, slot: torch.Tensor, s: Segment, g: torch.Tensor, o: torch.Tensor | None) -> None:
        """AdamW on segment s of group i (in its slot) from gradient g; o (if any) receives the new weights."""
        _, p, m, v = self._sections(i, slot)
        b1, b2 = self.betas
        a, b = s.group_off, s.group_off + s.numel
        fused = o if o is not None and o.dtype != torch.float32 else None  # the kernel emits bf16/fp16
        adamw_update(
            p[a:b],
            m[a:b],
            v[a:b],
            g,
            fused,
            self.step_count,
            self.lr,
            b1,
            b2,
            self.eps,
            self.weight_decay,
            impl=self.impl,
            simd=self.simd,
        )
        if o is not None and fused is None:
            o.copy_(p[a:b])  # an fp32 copy of the weights, e.g. for an fp32 device

    def _read(self, i: int) -> StoreFuture[torch.Tensor]:
        rec, _, _, _ = self._sections(i, self.slots[i % len(self.slots)])
        return self.store.get_async(self._key(i), out=rec)

    def _write(self, i: int) -> StoreFuture[None]:
        rec, _, _, _ = self._sections(i, self.slots[i % len(self.slots)])
        return self.store.put_async(self._key(i, self._writing), rec)

    def _run_serial(self, update) -> None:
        for i in range(len(self.groups)):
            self._read(i).result()
            update(i, self.slots[i % len(self.slots)])
            self._write(i).result()

    def _run_pipelined(self, update) -> None:
        k, n = len(self.slots), len(self.groups)
        ahead = k - 1 if k < n else n  # with a slot per group, read them all at once
        futures: dict[tuple[str, int], StoreFuture[torch.Tensor | None]] = {
            ("r", i): self._read(i) for i in range(ahead)
        }
        try:
            for i in range(n):
                futures.pop(("r", i)).result()
                update(i, self.slots[i % k])
                futures[("w", i)] = self._write(i)
                nxt = i + k - 1  # goes into group i-1's slot once its write-back ended
                if k < n and nxt < n:
                    if i >= 1:
                        futures.pop(("w", i - 1)).result()
                    futures[("r", nxt)] = self._read(nxt)
        except BaseException:
            drain(futures.values())  # the slots must be idle before anyone reuses them
            raise
        for f in futures.values():
            f.result()

    # ------------------------------------------------------------------ reading states back
    def read_state(self, parts: tuple[str, ...] = STATE_PARTS) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's `parts` of {"param", "exp_avg", "exp_avg_sq"} as fp32 tensors of its shape
        (allocates them for the whole model in memory: for exports, checks and tests)."""
        out = {n: {k: torch.empty(self.shapes[n]) for k in parts} for n in self.names}
        for i, segs in enumerate(self.groups):
            self._read(i).result()
            _, p, m, v = self._sections(i, self.slots[i % len(self.slots)])
            for s in segs:
                for key, src in zip(STATE_PARTS, (p, m, v)):
                    if key not in parts:
                        continue
                    dst = out[s.name][key].view(-1)
                    dst[s.param_off : s.param_off + s.numel] = src[s.group_off : s.group_off + s.numel]
        return out

    def write_state(self, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """The inverse of read_state: every parameter's {"param", "exp_avg", "exp_avg_sq"} (fp32, its numel)
        written into the store's records, and the step count set (resuming from a checkpoint)."""
        pending: list[StoreFuture[None]] = []
        for i, segs in enumerate(self.groups):
            if len(pending) >= len(self.slots):
                pending.pop(0).result()
            rec, p, m, v = self._sections(i, self.slots[i % len(self.slots)])
            rec.zero_()
            for s in segs:
                for key, dst in (("param", p), ("exp_avg", m), ("exp_avg_sq", v)):
                    src = state[s.name][key].reshape(-1)
                    dst[s.group_off : s.group_off + s.numel].copy_(src[s.param_off : s.param_off + s.numel])
            pending.append(self.store.put_async(self._key(i), rec))
        for f in pending:
            f.result()
        self.restored(step)

    def restored(self, step: int) -> None:
        """The records hold whole states again (written, or adopted from a checkpoint) at `step`: what a failed step
        broke is mended, in the store's metadata too (open() refuses a folder marked broken)."""
        self.step_count, self.broken = step, ""
        self.store.meta[self.prefix].pop("broken", None)
        self._save_meta()

    def flush(self) -> None:
        """Make the states, the step count and the current hyper-parameters durable (the store's flush).
        Refused after a failed step: a checkpoint of half-stepped states would resume silently wrong; and while a
        tentative step is pending."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.pending:
            raise RuntimeError("OutOfCoreAdam.flush: a tentative step is pending: commit() or roll_back() it first")
        self._save_meta()
        self.store.flush()

    def _save_meta(self) -> None:
        """Step count and hyper-parameters (a schedule may have changed lr) into the store's metadata."""
        self.store.meta[self.prefix].update(
            step=self.step_count, lr=self.lr, betas=list(self.betas), eps=self.eps, weight_decay=self.weight_decay
        )

    # ------------------------------------------------------------------ checks
    def _check_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.names if n not in grads]
        extra = [n for n in grads if n not in self.numels]
        if missing or extra:
            raise ValueError(
                f"step() needs a gradient for every parameter: missing {missing[:5]}, unknown "
                f"{extra[:5]} (of {len(self.names)} parameters)"
            )
        return {n: _flat(g, n, self.numels[n], GRAD_DTYPES, "gradient") for n, g in grads.items()}

    def _check_outputs(self, outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        extra = [n for n in outs if n not in self.numels]
        if extra:
            raise ValueError(f"low_precision_out names unknown parameters {extra[:5]}")
        return {
            n: _flat(o, n, self.numels[n], (torch.bfloat16, torch.float16, torch.float32), "weights output")
            for n, o in outs.items()
        }


def _flat(t: torch.Tensor, name: str, numel: int, dtypes: tuple, what: str) -> torch.Tensor:
    if t.numel() != numel or t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"the {what} of {name!r} must be a contiguous CPU tensor of {numel} elements in "
            f"{[str(d) for d in dtypes]}; got {t.numel()} elements, {t.dtype}, on {t.device}, "
            f"contiguous={t.is_contiguous()}"
        )
    return t.view(-1)
