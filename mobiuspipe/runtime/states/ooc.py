"""The out-of-core Adam of a stage whose states are on SSD: the tier it lives in, the least host budget it takes, and
how it is made, settled after a tentative step, exported and imported."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mobiuspipe.memory.aio import ALIGN
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.weight_stream import BUFFERS
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam
from mobiuspipe.optim.ooc_groups import ELEM_ALIGN, least_budget_bytes
from mobiuspipe.optim.ooc_links import adopt_records, link_records, read_records

__all__ = [
    "ADAM_SLOTS",
    "SsdTier",
    "least_share",
    "ooc_adam",
    "settle_ooc",
    "export_ooc",
    "import_ooc",
    "in_memory",
]

ADAM_SLOTS = 4
"""Group slots of each stage's out-of-core Adam (read ahead, update, write back, one spare)."""


def least_share(dtype_bytes: int) -> int:
    """The least host budget of a stage on SSD: the out-of-core Adam's slots of one 4 KiB-aligned group each,
    and the weight stream's staging buffers of one group (a group of 1024 elements of dtype_bytes <= 4 fits
    one 4 KiB page)."""
    return least_budget_bytes(ADAM_SLOTS) + BUFFERS * ALIGN * max(1, -(-ELEM_ALIGN * dtype_bytes // ALIGN))


@dataclass(frozen=True)
class SsdTier:
    """One rank's store and the host memory each of its stages on SSD may use."""

    store: SSDStore
    host_budget_bytes: int
    hyper: AdamHyper


def ooc_adam(flat: torch.Tensor, tier: SsdTier, prefix: str, budget: int) -> OutOfCoreAdam:
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


def settle_ooc(opt: OutOfCoreAdam, keep: bool, lr_before: float) -> None:
    """Keep an out-of-core Adam's tentative step, or roll it back with the learning rate it had before it."""
    if keep:
        opt.commit()
    else:
        opt.roll_back()
        opt.lr = lr_before


def export_ooc(opt: OutOfCoreAdam, link_dir: Path | None) -> tuple[dict[str, torch.Tensor], dict]:
    """An out-of-core AdamW's states in export_state's form: its records hard-linked into link_dir (no bytes
    copied; copied file by file where link_dir's filesystem cannot link them), or without link_dir read from the
    store (fp32 flat)."""
    if link_dir is not None:
        return {}, {"records": link_records(opt, link_dir)}
    return _tensors(opt.read_state()["w"], opt.step_count), {}


def in_memory(tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None) -> dict[str, torch.Tensor]:
    """export_state's tensors of a stage whose states a checkpoint took from the SSD store (read from their records
    in link_dir), for a run that keeps them in memory (memory.optimizer changed, or auto under another host
    budget); any other stage's `tensors` as they are."""
    if "records" not in extra:
        return tensors
    if link_dir is None:
        raise ValueError("the states were linked into a checkpoint folder: pass it to import_state")
    states, step = read_records(link_dir, extra["records"])
    return _tensors(states["w"], step)


def _tensors(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """An out-of-core AdamW's states of its one flat parameter in export_state's form."""
    tensors = {"master": state["param"], "opt/exp_avg": state["exp_avg"], "opt/exp_avg_sq": state["exp_avg_sq"]}
    tensors["opt/step"] = torch.tensor(float(step), dtype=torch.float32)
    return tensors


def import_ooc(opt: OutOfCoreAdam, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None) -> None:
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
