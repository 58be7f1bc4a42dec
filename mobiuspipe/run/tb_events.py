"""TensorBoard event files of a run: the scalars of each metrics.jsonl record, written beside it by rank 0.

A record's numeric keys become tags "GROUP/KEY" (train/loss, time/step_s, memory/host_rss_bytes, ...; see
TAG_GROUPS), each rank's own figures "rank{r}/KEY", an evaluation's "eval/loss" and "eval/perplexity", all
at the record's step; so every value TensorBoard shows is one of metrics.jsonl (as float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TAG_GROUPS", "EventLog", "scalars"]

TAG_GROUPS = {
    "loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "tokens_per_s": "train",
    "tflops": "train",
    "mfu": "train",
    "eta_s": "train",
    "loss_scale": "train",
    "skipped": "train",
    "step_s": "time",
    "compute_s": "time",
    "load_s": "time",
    "comm_s": "time",
    "checkpoint_s": "time",
    "device_peak_bytes": "memory",
    "arena_peak_bytes": "memory",
    "host_rss_bytes": "memory",
    "ssd_bytes": "memory",
    "perplexity": "eval",
}
"""The tag group of each metrics.jsonl key TensorBoard shows (a train record's keys; an eval record's go
under "eval"). Keys left out are constant over a run (arena_budget_bytes, flops_per_step) or not numbers."""

EVENTS_PREFIX = "events.out.tfevents."
"""How TensorBoard's event files are named."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Tag -> value of one metrics.jsonl record (a record's None values have no tag)."""
    eval_ = record.get("kind") == "eval"
    out = {}
    for key, value in record.items():
        if key in TAG_GROUPS and _number(value):
            out[f"{'eval' if eval_ else TAG_GROUPS[key]}/{key}"] = float(value)
    ranks: list[dict[str, Any]] = record.get("ranks") or []
    for r, own in enumerate(ranks):
        out.update({f"rank{r}/{k}": float(v) for k, v in own.items() if k in TAG_GROUPS and _number(v)})
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool is an int: a skipped step is 1


class EventLog:
    """A SummaryWriter on `folder`; event files of an earlier run there are removed first (as metrics.jsonl is
    overwritten), so TensorBoard shows this run alone (a resumed run keeps them up to its first step)."""

    def __init__(self, folder: str | Path, first_step: int = 0):
        """first_step > 0: a resumed run; the earlier files stay and TensorBoard drops their later steps."""
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard (a second): only when asked

        if first_step == 0:
            for old in Path(folder).glob(EVENTS_PREFIX + "*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=first_step or None)
        self.folder = Path(folder)

    @property
    def path(self) -> Path:
        """The events file this log writes (the newest in its folder)."""
        files = sorted(self.folder.glob(EVENTS_PREFIX + "*"), key=lambda p: p.stat().st_mtime)
        return files[-1] if files else self.folder / EVENTS_PREFIX

    def add(self, record: dict[str, Any]) -> None:
        """Every scalar of the record at its step, flushed (TensorBoard shows a running job's steps)."""
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
