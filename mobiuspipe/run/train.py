"""The torchrun entry: `torchrun --nproc_per_node N -m mobiuspipe.train --config FILE.yaml`.

Each rank is one gpu of the plan: the model (model.hf's Hugging Face model, or the built-in GPT) goes
through the public Pipeline (mobiuspipe.pipeline), which builds only this rank's stages, keeps their
weights in their tiers and runs its schedule every step; rank 0 reports. At the end every rank writes its
stages' weights (out_dir/weights) and its shards of the export (train.export_dir). Errors a user can fix
print one line and exit 2; those found at start-up, alike on every rank (a bad config, data, plan, or the
checkpoint to resume from), print on each host's first rank only, or under `mobiuspipe train` go to it (it prints
them once and exits 2: mobiuspipe.run.preflight).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.elastic.multiprocessing.errors import record

from foundation.errors import UserError
from foundation.files import write_text_whole
from foundation.timing import Stopwatch
from mobiuspipe.checkpoint import CheckpointError
from mobiuspipe.config import RunConfig, load_config
from mobiuspipe.data.dataset import PackedTokens, open_run_data
from mobiuspipe.errors import ExportError, OutputError
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.memory.device import deterministic_kernels
from mobiuspipe.memory.store.index import fsync_path
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.models.hf import HFModel, open_hf
from mobiuspipe.models.hf import layer_factories as hf_layer_factories
from mobiuspipe.models.hf_export import check_export_dir, finish_export, partial_dir, shard_name, write_shard
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.host_threads import rank_threads
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.profiling.profiler import TORCH_DTYPES
from mobiuspipe.run.banner import start_line
from mobiuspipe.run.checkpoints import Checkpointer, StopSignals
from mobiuspipe.run.flops import device_name, flops_per_token, peak_tflops
from mobiuspipe.run.metrics import Reporter, device_peak_line, step_metrics
from mobiuspipe.run.parent_death import ENV as DEATH_ENV
from mobiuspipe.run.parent_death import die_with_parent
from mobiuspipe.run.preflight import at_start_up, rank_checks, report
from mobiuspipe.run.resume import (
    refuse_later_checkpoints,
    refuse_past_end,
    refuse_writing_over,
    resume_run,
    run_identity,
)
from mobiuspipe.run.run_lock import TOKEN_ENV, RunFolderError, RunLocks, new_token, run_folders
from mobiuspipe.run.usage import RankStep, folder_bytes, host_rss_bytes
from mobiuspipe.runtime.action_trace import as_sim_result, write_chrome
from mobiuspipe.runtime.peers.ranks import gather_all
from mobiuspipe.startup.config_plan import adapters, model_spec
from mobiuspipe.startup.lora import lora_spec, starting_adapters, write_adapter
from mobiuspipe.step_result import StepResult
from partition.plan import Plan, save_plan
from partition.report.trace import svg_timeline

__all__ = ["main", "open_run", "train", "with_resume"]


def train(cfg: RunConfig) -> None:
    """Train the config's model for cfg.train.steps steps as this rank of the job (the group must not exist yet)."""
    torch.set_num_threads(rank_threads(cfg.runtime.threads))
    if cfg.runtime.deterministic:
        deterministic_kernels()
    torch.manual_seed(cfg.train.seed)  # dropout masks (the recompute replays each forward's)
    t = cfg.train
    optimizer = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    with at_start_up():  # before the group exists: bad input stops every rank alike
        hf, data, held_out = open_run(cfg)
        plan = rank_checks(cfg)
    first = int(os.environ.get("RANK", "0")) == 0
    with _folder_locks(cfg, first):
        _train(cfg, hf, data, held_out, plan, optimizer, first)


def _folder_locks(cfg: RunConfig, first: bool) -> RunLocks:
    """Rank 0 holds the run's folders for the run (mobiuspipe.run.run_lock): they are its launcher's already under
    `mobiuspipe train`; under a user's own torchrun it takes them, or stops if another run holds one."""
    if not first:
        return RunLocks()
    folders = run_folders(cfg.train.out_dir, cfg.train.checkpoint_root, cfg.memory.ssd_dir)
    with at_start_up():
        return RunLocks.take(folders, new_token(), inherited=os.environ.get(TOKEN_ENV))


def _train(
    cfg: RunConfig,
    hf: HFModel | None,
    data: PackedTokens,
    held_out: PackedTokens | None,
    plan: Plan,
    optimizer: Callable,
    first: bool,
) -> None:
    """train() once the inputs are checked and the folders held."""
    t, lora = cfg.train, lora_spec(cfg)
    export = Path(t.export_dir) if t.export_dir else None
    if export is not None and first:
        shutil.rmtree(partial_dir(export), ignore_errors=True)  # an earlier run's remains
    with (
        Pipeline(
            hf_layer_factories(hf) if hf else layer_factories(model_spec(cfg), t.seed),
            lm_loss,
            plan=plan,
            optimizer=optimizer,
            num_microbatches=cfg.data.num_microbatches,
            precision=t.precision,
            memory=cfg.memory,
            comm_timeout_s=cfg.runtime.comm_timeout_s,
            hang_timeout_s=cfg.runtime.hang_timeout_s,
            tied=hf.tied_params() if hf else (),
            accumulation_steps=t.accumulation_steps,
            max_grad_norm=t.max_grad_norm,
            delayed_update=t.delayed_update,
            speculative_update=t.speculative_update,
            trace_steps=cfg.runtime.trace_steps,
            lora=lora,
            adapters=starting_adapters(cfg, hf),
        ) as pipe,
        StopSignals() as signals,
    ):  # a stop after the last step waits for the outputs too
        done = _training_loop(cfg, pipe, data, held_out, signals)
        exported = False
        if hf is not None and export is not None and done:
            exported = True
            if lora is None:
                _export(pipe, hf, export, TORCH_DTYPES[t.export_dtype], _export_owner(cfg))
            else:
                _export_adapter(pipe, hf, lora, export, TORCH_DTYPES[t.export_dtype], _export_owner(cfg))
        if done and signals.received and pipe.rank == 0:
            _say_late_stop(signals.received, bool(t.out_dir), export if exported else None)


def _say_late_stop(signal_name: str, weights: bool, export: Path | None) -> None:
    """Rank 0's word on a stop signal that came after the last step, once the run's outputs are written."""
    what = ["the final weights"] * weights + [f"the export to {export}"] * (export is not None)
    if what:
        print(
            f"mobiuspipe: {signal_name} came after the last step: {' and '.join(what)} were written first", flush=True
        )


def with_resume(cfg: RunConfig, resume: str | None) -> RunConfig:
    """cfg with train.resume set from the command line (checked like the file's), or as it is."""
    if resume is None:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=resume))


def open_run(cfg: RunConfig) -> tuple[HFModel | None, PackedTokens, PackedTokens | None]:
    """What a run reads before any work, each checked (UserError naming the key and the fix): the Hugging Face
    model folder (config and weight index, not the weights), the export folder, the training and held-out
    data. `mobiuspipe train` calls it before launching torchrun, and each rank at start-up."""
    hf = open_hf(cfg.model.hf, cfg.model.seq_len) if cfg.model.hf else None
    if cfg.train.export_dir:
        check_export_dir(Path(cfg.train.export_dir), "train.export_dir", _export_owner(cfg))  # before any work
    return (hf, *open_run_data(cfg))


def _export_owner(cfg: RunConfig) -> str:
    """Who an export belongs to: the run (its out_dir, else its config file), whose later exports replace it."""
    return str(Path(cfg.train.out_dir or cfg.source).resolve())


def _export(pipe: Pipeline, hf: HFModel, to: Path, dtype: torch.dtype, owner: str) -> None:
    """Every rank writes its stages' shards; rank 0 writes the index and config and renames the folder (replacing
    an export of the same owner: a finished run extended or resumed)."""
    folder, stages = partial_dir(to), pipe.plan.num_stages
    shards: dict[int, dict[str, int]] = {}
    failure = None
    for j, w in pipe.stage_state_dicts().items():
        try:
            shards[j] = write_shard(hf, j, stages, w, folder, dtype)
        except (OSError, SafetensorError) as e:  # safetensors reports a failed write (a full disk) as its own error
            failure = f"rank {pipe.rank} could not write {folder / shard_name(j, stages)}: {e}"
            break
    every = gather_all(pipe.info, failure or shards)  # every rank's result: none is left waiting when one failed
    failed = [d for d in every if isinstance(d, str)]
    if failed:
        raise ExportError(f"{failed[0]}; free space there (or fix the folder), then export with `mobiuspipe export`")
    if pipe.rank == 0:
        finish_export(hf, {j: names for d in every for j, names in d.items()}, stages, to, dtype, owner)
        print(f"mobiuspipe: exported the fine-tuned model to {to} ({dtype}; from_pretrained loads it)", flush=True)


def _export_adapter(pipe: Pipeline, hf: HFModel, spec: LoraSpec, to: Path, dtype: torch.dtype, owner: str) -> None:
    """Rank 0 gathers every rank's adapters and writes PEFT's adapter folder, which PeftModel.from_pretrained
    loads onto model.hf (replacing an export of the same owner)."""
    every = gather_all(pipe.info, pipe.state_dict(frozen=False))
    if pipe.rank == 0:
        try:
            write_adapter(hf, spec, {k: v for d in every for k, v in d.items()}, to, dtype, owner)
        except (OSError, SafetensorError) as e:  # the earlier export stays in place
            why = f"could not write the LoRA adapter to {to}: {e}"
            raise ExportError(
                f"{why}; free space there (or fix the folder), then export with `mobiuspipe export`"
            ) from e
        print(
            f"mobiuspipe: exported the LoRA adapter to {to} ({dtype}; PeftModel.from_pretrained(base, DIR) loads it "
            f"onto {hf.folder})",
            flush=True,
        )


def _training_loop(
    cfg: RunConfig, pipe: Pipeline, data: PackedTokens, held_out: PackedTokens | None, signals: StopSignals
) -> bool:
    """Every step on this rank, and the evaluations on the held-out data; rank 0 reports and writes out_dir;
    every rank writes its stages' weights. False when a signal stopped the run (after a checkpoint); one that
    comes after the last step is left for the caller (the weights are written meanwhile)."""
    rank, plan = pipe.rank, pipe.plan
    out = Path(cfg.train.out_dir) if cfg.train.out_dir else None
    if rank == 0:
        print(start_line(cfg, plan, pipe.state_tiers, data.describe()), flush=True)
    done = _steps(cfg, pipe, data, held_out, signals)
    _report_device_peak(pipe)
    if cfg.runtime.trace_steps:
        _write_trace(pipe, out)
    if out and done:
        _save_weights(pipe, out / "weights")
    return done


def _steps(
    cfg: RunConfig, pipe: Pipeline, data: PackedTokens, held_out: PackedTokens | None, signals: StopSignals
) -> bool:
    """The steps from where the run resumes; True when every step ran, False when a signal stopped it."""
    run = run_identity(cfg)
    said: list[str] = []  # where the run starts, told once nothing refuses the start
    with at_start_up((CheckpointError, RunFolderError)):  # every rank raises the same (not a lost peer's error)
        start = resume_run(cfg.train, pipe, run, said.append)
        refuse_later_checkpoints(cfg.train, pipe, start)
        refuse_past_end(cfg.train, pipe, start)
        refuse_writing_over(cfg.train, pipe, start)
    for line in said:
        print(f"mobiuspipe: {line}", flush=True)
    _write_records(cfg, pipe)  # once every start-up check, the resume's included, has passed
    checkpoints = Checkpointer(cfg.train, pipe, cfg.to_yaml(), run)
    try:
        return _run_steps(cfg, pipe, data, held_out, signals, checkpoints, start)
    finally:
        checkpoints.close()


def _write_records(cfg: RunConfig, pipe: Pipeline) -> None:
    """Rank 0 writes the run's config and plan into out_dir (config.yaml, plan.yaml)."""
    out = Path(cfg.train.out_dir) if cfg.train.out_dir else None
    if out is None or pipe.rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, write in (
        ("config.yaml", lambda path: write_text_whole(path, cfg.to_yaml())),  # a resume writes over it: whole or not
        ("plan.yaml", lambda path: save_plan(pipe.plan, path)),
    ):
        try:
            write(out / name)
        except OSError as e:
            raise OutputError.of(0, out / name, e) from e


def _run_steps(
    cfg: RunConfig,
    pipe: Pipeline,
    data: PackedTokens,
    held_out: PackedTokens | None,
    signals: StopSignals,
    checkpoints: Checkpointer,
    start: int,
) -> bool:
    """Steps start .. train.steps - 1 (see _steps)."""
    t, rank, out = cfg.train, pipe.rank, cfg.train.out_dir
    rows = t.accumulation_steps * cfg.data.batch_size  # sequences per optimizer step
    tokens = rows * cfg.model.seq_len
    step_flops = flops_per_token(model_spec(cfg), adapters(cfg)) * tokens
    peaks = gather_all(pipe.info, peak_tflops(device_name(pipe.info.local_rank)))
    with Reporter(
        t.steps, t.log_every, out if rank == 0 else None, sys.stdout if rank == 0 else None, t.tensorboard, start
    ) as report:
        if held_out is not None and t.eval_at_start and start == 0:
            report.eval(-1, evaluate(pipe, held_out, cfg.data.batch_size, t.eval_batches))
        saved_s = None  # the last checkpoint's seconds, reported with the step after it
        for step in range(start, t.steps):
            sw = Stopwatch()
            x, y = data.batch(step, rows)
            lr = t.lr_of(step)
            pipe.set_lr(lr)
            r = pipe.train_batch(x, y)
            own = _own_figures(pipe, r, sw.s)
            every = gather_all(pipe.info, (own, signals.received, checkpoints.status()))  # a collective
            stop = next((s for _, s, _ in every if s), None)
            if rank == 0:  # the step's record before its checkpoint: a resumed run finds every earlier step's
                report(step_metrics(r, lr, [o for o, _, _ in every], tokens, step_flops, peaks, saved_s))
            if held_out is not None and _evaluates_after(step, t.eval_every, t.steps):
                report.eval(step, evaluate(pipe, held_out, cfg.data.batch_size, t.eval_batches))
            saved_s = checkpoints.after_step([c for _, _, c in every], stop is not None)
            if stop is not None:
                if rank == 0:
                    print(f"mobiuspipe: stopped by {stop} after step {step} [{step + 1}/{t.steps}]", flush=True)
                return False
        checkpoints.finish()
    return True


def _evaluates_after(step: int, every: int, steps: int) -> bool:
    """Whether an evaluation follows optimizer step `step` (0-based): every `every` steps and after the last."""
    return step + 1 == steps or (every > 0 and (step + 1) % every == 0)


def evaluate(pipe: Pipeline, held_out: PackedTokens, batch_size: int, max_batches: int | None) -> float:
    """The mean loss of the pipeline's current weights over the held-out batches (each one pipeline forward
    on every rank; the full batches hold equally many tokens, so the mean of their means is the token mean)."""
    losses = [pipe.eval_batch(x, y) for x, y in held_out.eval_batches(batch_size, max_batches)]
    return sum(losses) / len(losses)


def _own_figures(pipe: Pipeline, r: StepResult, step_s: float) -> RankStep:
    """This rank's own times (summed over the step's passes), device peak, RSS and SSD bytes of step r."""
    t, store = r.own_times, pipe.store
    return RankStep(
        step_s,
        t.compute_s,
        t.load_s,
        t.comm_s,
        r.own_device_peak_bytes,
        host_rss_bytes(),
        None if store is None else folder_bytes(store.folder),
    )


def _write_trace(pipe: Pipeline, out: Path | None) -> None:
    """Rank 0 writes every rank's traced actions to out_dir/trace.json (runtime.trace_steps), once the host
    updates that may still run have recorded theirs, and draws the last traced step that ran in trace.svg (a run
    stopped or resumed past its traced steps has none to draw)."""
    pipe.wait_updates()
    every = gather_all(pipe.info, pipe.trace.records)
    if pipe.rank != 0 or out is None:
        return
    path = write_chrome(every, out / "trace.json")
    ran = sorted({r.step for recs in every for r in recs})
    drawn = ""
    if ran:
        measured = as_sim_result(every, ran[-1])
        title = f"step {ran[-1]} as it ran: {measured.step_time_s * 1e3:.1f} ms"
        drawn = f"; step {ran[-1]} drawn in {svg_timeline(measured, len(every), out / 'trace.svg', title)}"
    print(f"mobiuspipe: the actions of steps {ran} are in {path}{drawn}", flush=True)


def _report_device_peak(pipe: Pipeline) -> None:
    """Every rank sends its measured device peak over the run (and what its ledger held then); rank 0 prints
    them against the plan's figure per gpu in one line."""
    run_bytes, run_parts, source = pipe.device_peak()
    every = gather_all(pipe.info, (run_bytes, run_parts))
    if pipe.rank == 0:
        measured = [b for b, _ in every]
        parts = max(every, key=lambda e: e[0])[1]
        print(device_peak_line(measured, pipe.planned_device_bytes(), source, parts), flush=True)


def _save_weights(pipe: Pipeline, folder: Path) -> None:
    """Each rank writes its stages' trained weights: weights/stage{j}.pt, a dict "layer.param" -> tensor (under
    LoRA the adapters alone: the frozen base is model.hf's, or the seed's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for j, weights in pipe.stage_state_dicts(frozen=False).items():
        tmp = folder / f".stage{j}.pt.tmp"
        try:
            with open(tmp, "wb") as f:  # a file object: a failed write is an OSError with its errno
                torch.save(weights, f)
            fsync_path(tmp)  # on the disk before it takes the name
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OutputError.of(pipe.rank, tmp, e) from e
        tmp.replace(folder / f"stage{j}.pt")
    fsync_path(folder)


@record
def restart_note(env: Mapping[str, str], resume: str | None) -> str | None:
    """Rank 0's first line in an attempt torchrun started again after a rank failed (--max-restarts; torchrun's agent
    sets TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS): None on the first attempt and on other ranks."""
    count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count == 0 or env.get("RANK", "0") != "0":
        return None
    where = (
        "no train.resume: the run starts again at step 0, which a folder with its checkpoints refuses (--resume auto)"
        if resume is None
        else f"train.resume {resume}: the run goes on from "
        + ("its newest complete checkpoint" if resume == "auto" else resume)
    )
    most = env.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return (
        f"mobiuspipe: torchrun started the ranks again after a rank failed (restart {count} of at most {most}, "
        f"--max-restarts); {where}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mobiuspipe.train", description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    p.add_argument("--resume", default=None, metavar="auto|PATH", help="train.resume: auto or a step-N folder")
    args = p.parse_args(argv)
    if os.environ.get(DEATH_ENV):  # started by `mobiuspipe train`: no rank outlives its torchrun
        die_with_parent(os.getppid())
    try:
        with at_start_up():
            cfg = with_resume(load_config(args.config), args.resume)
        if (note := restart_note(os.environ, cfg.train.resume)) is not None:
            print(note, flush=True)
        train(cfg)
    except UserError as e:
        return report(e, "mobiuspipe.train")
    return 0


def _leave(code: int | None) -> None:
    """Exit with code at once (os._exit), once main has closed what the run opened and the output is flushed.
    The interpreter's teardown of torch and gloo's threads aborted ranks ("terminate called without an active
    exception", SIGABRT) after a reported mistake in 3 of 16 runs, and once in CI after a run that had
    finished: torchrun then reported a failed job whose work was all done and written."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def entry() -> None:
    """Run main on the command line's arguments and leave the process with its code (the torchrun entry)."""
    _leave(main())


if __name__ == "__main__":
    entry()
