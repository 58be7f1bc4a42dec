"""Per-step metrics of a training run: a progress bar on a terminal, plain lines otherwise, metrics.jsonl and
TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from foundation.files import fsync_folder
from foundation.units import MiB, fmt_bytes
from mobiuspipe.errors import OutputError
from mobiuspipe.run.flops import rate
from mobiuspipe.run.tb_events import EventLog
from mobiuspipe.run.usage import RankStep
from mobiuspipe.step_result import StepResult

__all__ = ["StepMetrics", "Reporter", "device_peak_line", "step_metrics", "perplexity", "recorded_steps"]


@dataclass(frozen=True)
class StepMetrics:
    """What one step did: the Pipeline's StepResult (loss, the largest time of each part and the largest peaks over
    ranks) and what the run adds to it. step_s is rank 0's wall time (tokens_per_s, tflops and eta_s follow from
    it); `ranks` has each rank's own figures. record() is the step's metrics.jsonl object."""

    result: StepResult
    tokens_per_s: float
    step_s: float
    lr: float | None = None
    """The learning rate of the step's updates (train.lr_schedule); None when the loop did not set one."""
    ranks: tuple[RankStep, ...] = ()
    """Each rank's own figures of the step, by rank (empty when not gathered)."""
    flops_per_step: float = 0.0
    """Model FLOPs of the step: forward + backward, recompute not counted (mobiuspipe.run.flops)."""
    tflops: float | None = None
    """flops_per_step / step_s / 1e12."""
    mfu: float | None = None
    """tflops over the sum of the ranks' device peaks (partition/spec/hardware.py); None for a device not listed."""
    host_rss_bytes: int | None = None
    """The largest resident memory (RSS) of a rank's process at the end of the step."""
    ssd_bytes: int | None = None
    """Bytes on disk of the run's SSD stores (memory.ssd_dir/rank*), summed over ranks; None without any."""
    checkpoint_s: float | None = None
    """Seconds rank 0 spent writing the checkpoint after the step before this one (not in either step_s);
    None when none was written then."""
    eta_s: float | None = None
    """Seconds left: the mean step_s so far without the first step (warm-up) times the steps left; the
    Reporter fills it in; None at the first step."""

    @property
    def step(self) -> int:
        return self.result.step

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl object of the step (without its "kind"): the step's StepResult figures (compute_s,
        load_s and comm_s each the largest over ranks, possibly of different ranks), then the run's."""
        r = self.result
        return {
            "step": r.step,
            "loss": r.loss,
            "tokens_per_s": self.tokens_per_s,
            "step_s": self.step_s,
            "compute_s": r.times.compute_s,
            "load_s": r.times.load_s,
            "comm_s": r.times.comm_s,
            "arena_peak_bytes": r.arena_peak_bytes,
            "arena_budget_bytes": r.arena_budget_bytes,
            "loss_scale": r.loss_scale,
            "skipped": r.skipped,
            "device_peak_bytes": r.device_peak_bytes,
            "lr": self.lr,
            "ranks": [asdict(x) for x in self.ranks],
            "flops_per_step": self.flops_per_step,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "host_rss_bytes": self.host_rss_bytes,
            "ssd_bytes": self.ssd_bytes,
            "grad_norm": r.grad_norm,
            "updates_rolled_back": r.updates_rolled_back,
            "checkpoint_s": self.checkpoint_s,
            "eta_s": self.eta_s,
        }

    def line(self, steps: int) -> str:
        """The step line: `step S [K/N]`, S the 0-based step of the metrics.jsonl record, K = S + 1 of N steps."""
        r = self.result
        head = [f"step {r.step} [{r.step + 1}/{steps}]", f"loss {r.loss:.4f}"]
        head += [] if self.lr is None else [f"lr {self.lr:.3g}"]
        head += [] if r.grad_norm is None else [f"grad norm {r.grad_norm:.3g}"]
        head += [] if self.eta_s is None else [f"ETA {_clock(self.eta_s)}"]
        head.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.tflops is not None:
            head.append(f"{self.tflops:.3g} TFLOPS" + ("" if self.mfu is None else f" MFU {100 * self.mfu:.3g}%"))
        tail = [] if r.loss_scale is None else [f"scale {r.loss_scale:g}"]
        tail += [] if self.checkpoint_s is None else [f"checkpoint {self.checkpoint_s * 1e3:.0f} ms"]
        tail += ["(overflow: step skipped)"] if r.skipped else []
        return "  ".join([*head, self._times(), self._memory(), *tail])

    def _times(self) -> str:
        ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
        if self.ranks:  # rank 0's own split of rank 0's wall time
            own = self.ranks[0]
            parts, who = (own.compute_s, own.load_s, own.comm_s), "rank 0: "
        else:
            t = self.result.times
            parts, who = (t.compute_s, t.load_s, t.comm_s), "max over ranks: "
        return f"step {ms(self.step_s)} ms ({who}compute {ms(parts[0])} / load {ms(parts[1])} / comm {ms(parts[2])})"

    def _memory(self) -> str:
        n = len(self.ranks)
        who = f"max over {n} rank{'s' if n != 1 else ''}" if n else "max over ranks"
        r = self.result
        mem = (
            f"{who}: device peak {fmt_bytes(r.device_peak_bytes)}, arena peak "
            f"{r.arena_peak_bytes / MiB:.2f} of {r.arena_budget_bytes / MiB:.2f} MiB"
        )
        mem += "" if self.host_rss_bytes is None else f", host RSS {fmt_bytes(self.host_rss_bytes)}"
        return mem + ("" if self.ssd_bytes is None else f"; ssd {fmt_bytes(self.ssd_bytes)} in all")


def step_metrics(
    r: StepResult,
    lr: float | None,
    ranks: list[RankStep],
    tokens: int,
    step_flops: float,
    peaks: list[float | None],
    checkpoint_s: float | None = None,
) -> StepMetrics:
    """The metrics of step r from every rank's own figures (rank 0's wall time is the step's), the step's
    tokens and model FLOPs and the ranks' device peaks (TFLOPS, None where unknown)."""
    step_s = ranks[0].step_s
    tflops, mfu = rate(step_flops, step_s, peaks)
    on_ssd = [x.ssd_bytes for x in ranks if x.ssd_bytes is not None]
    return StepMetrics(
        result=r,
        tokens_per_s=tokens / step_s,
        step_s=step_s,
        lr=lr,
        ranks=tuple(ranks),
        flops_per_step=step_flops,
        tflops=tflops,
        mfu=mfu,
        host_rss_bytes=max(x.host_rss_bytes for x in ranks),
        ssd_bytes=sum(on_ssd) if on_ssd else None,
        checkpoint_s=checkpoint_s,
    )


def perplexity(loss: float) -> float:
    """exp(loss) of a mean cross-entropy loss in nats; inf where that overflows a float."""
    return math.exp(loss) if loss < 709.0 else math.inf


def _open_records(path: Path, first_step: int) -> TextIO:
    """metrics.jsonl for appending, holding only the records of steps before first_step (a resumed run's
    earlier part; none for a new run)."""
    if first_step > 0 and path.is_file():
        _keep_records_before(path, first_step)
        return open(path, "a")
    return open(path, "w")


def _keep_records_before(path: Path, first_step: int) -> None:
    """Rewrite path with only its records of steps before first_step, read and written a line at a time through a
    file beside it that replaces it whole: a write that fails (a full disk) leaves every record where it was."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(path) as old, open(tmp, "w") as new:
            for line in old:
                if _step_of(line) < first_step:
                    new.write(line if line.endswith("\n") else line + "\n")
            new.flush()
            os.fsync(new.fileno())
        os.replace(tmp, path)
        fsync_folder(path.parent)
    except OSError as e:
        raise OSError(
            e.errno,
            f"could not keep the earlier records of {path} for the resumed run ({e.strerror or e}); the file is as it "
            f"was: free space in {path.parent} and start the run again",
        ) from e
    finally:
        tmp.unlink(missing_ok=True)


def recorded_steps(path: Path) -> int:
    """The training steps the metrics.jsonl at path records (0 without the file; torn lines are not steps)."""
    if not path.is_file():
        return 0
    steps = set()
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "train":
                steps.add(record.get("step"))
    return len(steps)


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a line torn by the crash the run resumes from."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class Reporter:
    """Shows each step on `stream` (a bar when it is a terminal; None = silent), appends it to
    out_dir/metrics.jsonl and, with `tensorboard`, to TensorBoard event files in out_dir (out_dir None =
    no files). Use it as a context manager, or call close()."""

    def __init__(
        self,
        steps: int,
        log_every: int,
        out_dir: str | None,
        stream: TextIO | None = sys.stdout,
        tensorboard: bool = True,
        first_step: int = 0,
    ):
        """first_step > 0: a resumed run; the records of earlier steps in out_dir stay, later ones go."""
        self.steps, self.log_every, self.stream = steps, log_every, stream
        self.tty = stream is not None and stream.isatty()
        self.file = None
        self.events: EventLog | None = None
        self.records = Path(out_dir) / "metrics.jsonl" if out_dir else None
        if out_dir and self.records is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            self.file = _open_records(self.records, first_step)
            self.events = EventLog(out_dir, first_step) if tensorboard else None
        self._timed, self._timed_s, self._first, self._bar_open = 0, 0.0, True, False

    def __call__(self, m: StepMetrics) -> None:
        m = replace(m, eta_s=self._eta(m))
        self._record({"kind": "train", **m.record()})
        last = m.step + 1 == self.steps
        if self.stream is None:
            return
        if self.tty:
            done = int(30 * (m.step + 1) / self.steps)
            width = shutil.get_terminal_size().columns - 1  # a wrapped line would break the \r redraw
            self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {m.line(self.steps)}"[: width + 1])
            self.stream.write("\n" if last else "")
            self._bar_open = not last
        elif (m.step + 1) % self.log_every == 0 or last:
            self.stream.write(m.line(self.steps) + "\n")
        self.stream.flush()

    def eval(self, step: int, loss: float) -> None:
        """Report an evaluation after training step `step` (0-based, as the step records; -1 = before the first
        step): its mean loss and perplexity, on the stream, in metrics.jsonl as {"kind": "eval", "step",
        "loss", "perplexity"}, and in TensorBoard as eval/loss and eval/perplexity."""
        ppl = perplexity(loss)
        self._record({"kind": "eval", "step": step, "loss": loss, "perplexity": ppl})
        if self.stream is None:
            return
        when = f"after step {step}" if step >= 0 else "before training"  # the record's own step number
        line = f"eval {when}: loss {loss:.4f}  perplexity {ppl:.4g}"
        self.stream.write(("\n" if self._bar_open else "") + line + "\n")
        self._bar_open = False
        self.stream.flush()

    def _eta(self, m: StepMetrics) -> float | None:
        """Seconds left after step m from the mean time of the steps reported so far but the first."""
        if not self._first:
            self._timed, self._timed_s = self._timed + 1, self._timed_s + m.step_s
        self._first = False
        return None if self._timed == 0 else self._timed_s / self._timed * max(0, self.steps - m.step - 1)

    def _record(self, record: dict[str, Any]) -> None:
        """Write record into metrics.jsonl and TensorBoard's events; OutputError (rank 0's, who writes them) when a
        write fails, the files closed."""
        try:
            if self.file:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
        except OSError as e:
            self._close_failed()
            raise OutputError.of(0, self.records or Path("metrics.jsonl"), e) from e
        try:
            if self.events:
                self.events.add(record)
        except OSError as e:
            where = self.events.path if self.events else Path("events")
            self._close_failed()
            raise OutputError.of(0, where, e) from e

    def _close_failed(self) -> None:
        """Close the files after a failed write (what their buffers still hold may fail to be written too)."""
        try:
            self.close()
        except OSError:
            self.file, self.events = None, None

    def close(self) -> None:
        """Close metrics.jsonl and the event files (flushed). Idempotent."""
        if self.file:
            self.file.close()
            self.file = None
        if self.events:
            self.events.close()
            self.events = None

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clock(seconds: float) -> str:
    """H:MM:SS."""
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def device_peak_line(measured: list[int], planned: list[int], source: str, parts: dict[str, int]) -> str:
    """One line comparing each rank's measured device peak over the run with the plan's figure for its gpu
    (partition.rules.device_peak), saying which is larger and by how much; `parts` explains the largest rank's
    peak (the ledger's bytes by kind)."""
    ranks = [
        f"rank {g} {fmt_bytes(m)} vs {fmt_bytes(p)}: {_larger(m, p)}" for g, (m, p) in enumerate(zip(measured, planned))
    ]
    top = max(range(len(measured)), key=lambda g: measured[g])
    held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    return (
        f"device peak, measured ({source}) vs planned (lifetime walk): {'; '.join(ranks)}; "
        f"rank {top} at its peak held {held}"
    )


def _larger(measured: int, planned: int) -> str:
    if measured == planned:
        return "equal"
    who = "measured" if measured > planned else "planned"
    rel = f" ({(measured - planned) / planned:+.0%} of plan)" if planned else ""
    return f"{who} larger by {fmt_bytes(abs(measured - planned))}{rel}"
