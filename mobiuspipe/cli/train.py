"""`mobiuspipe train`: check a run config, its data, plan and folders, then launch torchrun, one rank per planned gpu.

A mistake a rank finds (one `mobiuspipe train` could not see: a rank-only setting, the checkpoint to resume
from, a disk that fills up) is left in a folder named in the ranks' environment (mobiuspipe.run.preflight.ERRORS_ENV);
once torchrun has stopped, `mobiuspipe train` prints it as the last line and exits 2. What the job writes on stderr
after such a mistake, or after Ctrl-C (the other ranks' lost connections, torchrun's report of a failed job), is held
back and dropped, but for mobiuspipe's own lines (mobiuspipe.run.job_stderr). With --max-restarts it stops
torchrun as soon as a start-up mistake appears, since each restart would fail the same way.

On one machine torchrun runs `--standalone`. Across machines (--nnodes N > 1) the same command runs on
every host with its own --node-rank, and torchrun's c10d rendezvous at --rdzv-endpoint HOST:PORT (a
port on one of the hosts) gathers the N hosts; each starts nproc / N ranks. The c10d rendezvous numbers
the hosts itself (by host name; torchrun says it ignores --node_rank), so any host may get rank 0.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from mobiuspipe.cli._common import CliError, positive_int, ranks_per_node

if TYPE_CHECKING:
    from mobiuspipe.config import RunConfig
    from mobiuspipe.run.job_stderr import JobStderr

__all__ = ["register", "run", "torchrun_command"]

POLL_S = 0.1
"""With --max-restarts: how often to look for a rank's start-up mistake while torchrun runs (seconds)."""
STOPPED_BY = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}
"""The signals that stop a job (its ranks checkpoint first), as the last line names them. The exit code is
128 + the first one's number, as a shell reports a command a signal ended: 130 after Ctrl-C, 143 after SIGTERM."""
DEFAULT_RDZV_ID = "mobiuspipe"
"""The rendezvous id when --rdzv-id is not given: jobs sharing an endpoint need different ids."""


def register(sub) -> None:
    """Add the `train` subcommand to the CLI's subparsers."""
    p = sub.add_parser("train", help="launch torchrun on a YAML run config")
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="ranks to start over all nodes (default: the plan's gpu count); each node starts nproc / nnodes",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from the newest complete checkpoint (auto) or from a step-N folder (train.resume)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts the job this many times after a rank fails; with --resume auto each restart "
        "continues from the newest checkpoint (default 0)",
    )
    p.add_argument("--nnodes", type=positive_int, default=1, help="machines the job spans (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0 .. nnodes - 1")
    p.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the rendezvous: a port on one host (nnodes > 1)"
    )
    p.add_argument(
        "--rdzv-id", default=DEFAULT_RDZV_ID, help=f"the job's id, the same on every node (default {DEFAULT_RDZV_ID})"
    )
    p.add_argument(
        "--local-addr",
        default=None,
        metavar="ADDR",
        help="this host's address as the other hosts reach it (default: its host name, which they must resolve)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out) -> int:
    """Run torchrun; its ranks write straight to this process's stdout and stderr (`out` is flushed first).
    torchrun's exit code, or StartUpError (exit 2) with a rank's start-up mistake."""
    from mobiuspipe.config import load_config
    from mobiuspipe.errors import StartUpError
    from mobiuspipe.run.job_stderr import JobStderr
    from mobiuspipe.run.parent_death import ENV as DEATH_ENV
    from mobiuspipe.run.parent_death import launched_child
    from mobiuspipe.run.preflight import ERRORS_ENV, PLAN_ENV, launch_checks, lost_peer, rank_mistake
    from mobiuspipe.run.resume import refuse_before_launch
    from mobiuspipe.run.run_lock import TOKEN_ENV, RunLocks, new_token, refuse_held, run_folders
    from mobiuspipe.run.stop_relay import StopRelay
    from mobiuspipe.run.train import open_run, with_resume
    from partition.plan import save_plan

    # a bad config, model folder, data, plan or out_dir fails here, before any process starts
    config = with_resume(load_config(args.config), args.resume)
    if not _has_keys(Path(config.source)):
        print(
            f"mobiuspipe: {config.source} sets no key: every key takes its default (the built-in GPT on the built-in "
            f"text, {config.train.steps} steps, writing no files); examples/tiny-gpt.yaml shows them all",
            file=sys.stderr,
            flush=True,
        )
    open_run(config)
    # On one machine the run's folders are this run's until torchrun ends (its ranks find them held under `token`).
    # Across machines every host runs this command and any may get rank 0, which takes them at start-up instead.
    token = new_token() if args.nnodes == 1 else None
    folders = run_folders(config.train.out_dir, config.train.checkpoint_root, config.memory.ssd_dir) if token else {}
    if args.nnodes == 1:  # a new run in a used out_dir, before the plan is made (across machines rank 0's decides)
        refuse_held(folders)  # a live run's folder: in use, whatever it holds
        refuse_before_launch(config.train)
    nproc, plan = launch_checks(config, args.nproc, args.nnodes)
    relay = StopRelay()  # from here a stop signal stops the job, before torchrun runs too
    with (
        RunLocks.take(folders, token or ""),
        tempfile.TemporaryDirectory(prefix="mobiuspipe-start-up-") as errors,
        relay.installed(),
    ):
        cmd = torchrun_command(config.source, nproc, args, log_dir=str(Path(errors) / "torchrun"))
        print(f"mobiuspipe: launching {shlex.join(cmd)}", file=sys.stderr, flush=True)
        out.flush()
        env = {**os.environ, ERRORS_ENV: errors, DEATH_ENV: "1", **({TOKEN_ENV: token} if token else {})}
        env |= stop_grace_env(config)
        if not config.plan.file:  # the plan made above, for every rank: one plan however long the MIP took
            save_plan(plan, Path(errors) / "plan.yaml")
            env[PLAN_ENV] = str(Path(errors) / "plan.yaml")
        me = os.getpid()  # torchrun dies with this process, its ranks with torchrun (mobiuspipe.run.parent_death)
        torchrun = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, preexec_fn=lambda: launched_child(me), start_new_session=True
        )  # a session of its own: a signal reaches it once, from the relay, however it was sent
        assert torchrun.stderr is not None
        stderr = JobStderr(torchrun.stderr, sys.stderr.buffer, lambda: rank_mistake(Path(errors)) is not None)
        relay.started(torchrun, stderr.hold)
        stopped = relay.stopped
        code = _wait_for(torchrun, Path(errors) if args.max_restarts else None, stderr)
        mistake = rank_mistake(Path(errors)) if code != 0 else None
        stderr.finish(quiet=code != 0 and (mistake is not None or bool(stopped)))
        lost = lost_peer(Path(errors)) if code != 0 and mistake is None and not stopped else None
    if mistake is not None:
        raise StartUpError(mistake)
    if stopped and code != 0:
        first = stopped[0]
        print(f"mobiuspipe: stopped by {STOPPED_BY[first]}; torchrun and the ranks have ended", file=sys.stderr)
        return 128 + first
    if lost is not None:
        print(f"mobiuspipe: {lost}", file=sys.stderr, flush=True)  # the last word, after the failing rank's own
    return code


def _has_keys(path: Path) -> bool:
    """Whether a config file sets any key (an empty file, or comments alone, sets none)."""
    import yaml

    return bool(yaml.safe_load(path.read_text()))


def _wait_for(torchrun: subprocess.Popen, errors: Path | None, stderr: JobStderr) -> int:
    """torchrun's exit code. torchrun runs in a session of its own, so neither a terminal's Ctrl-C nor a signal to
    this process group reaches it: this process does not die of SIGINT or SIGTERM but passes either on to torchrun
    (mobiuspipe.run.stop_relay), which passes it to its ranks (they checkpoint and stop), and from then on the job's
    stderr is held (`stderr`). With `errors` (the ranks' mistakes folder) it stops torchrun once a start-up mistake
    is there, before it restarts."""
    from mobiuspipe.run.preflight import start_up_error

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    old_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    stderr.watch(wake_read, (signal.SIGINT, signal.SIGTERM))
    try:
        while errors is not None:
            try:
                return torchrun.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if start_up_error(errors) is not None:  # every restart would fail the same way
                    torchrun.send_signal(signal.SIGTERM)
                    errors = None
        return torchrun.wait()
    finally:
        signal.set_wakeup_fd(old_wakeup)
        os.close(wake_write)  # the read end is the pump's: closed when it finishes


SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""torchrun's (torch 2.13's) seconds between passing a stop signal to its ranks and killing them (default 30)."""


def stop_grace_env(config: RunConfig) -> dict[str, str]:
    """torchrun's environment for a stop: on Ctrl-C or SIGTERM the ranks finish the step under way and write a
    checkpoint, on a large model minutes, so torchrun waits runtime.hang_timeout_s for them (the longest one
    operation of live ranks may take) instead of killing them after 30 s; a value the user set stands. A scheduler's
    own grace before its SIGKILL (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds) must cover as much."""
    if SHUTDOWN_ENV in os.environ:
        return {}
    return {SHUTDOWN_ENV: str(max(30, round(config.runtime.hang_timeout_s)))}


def torchrun_command(config: str, nproc: int, args: argparse.Namespace, log_dir: str | None = None) -> list[str]:
    """The torchrun command line for `nproc` ranks over args.nnodes nodes (standalone on one node); CliError
    for node options that do not fit together. log_dir: where torchrun keeps its per-rank folders (by default it
    makes a /tmp/torchelastic_* folder a run and never removes it)."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    head += [] if log_dir is None else ["--log-dir", log_dir]
    tail = ["-m", "mobiuspipe.train", "--config", config]
    tail += [] if args.resume is None else ["--resume", args.resume]
    head += [] if not args.max_restarts else ["--max-restarts", str(args.max_restarts)]
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        if args.node_rank != 0:
            raise CliError(f"--node-rank is {args.node_rank} on a job of one node: give --nnodes N (> 1) as well")
        return [*head, "--nproc_per_node", str(nproc), "--standalone", *tail]
    per_node = ranks_per_node(nproc, args.nnodes)
    if not 0 <= args.node_rank < args.nnodes:
        raise CliError(
            f"--node-rank must be in 0 .. {args.nnodes - 1} (--nnodes {args.nnodes}), found {args.node_rank}: "
            f"number the machines 0, 1, ... and give each its own"
        )
    nodes = [
        "--nnodes",
        str(args.nnodes),
        "--node_rank",
        str(args.node_rank),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        _endpoint(args.rdzv_endpoint),
        "--rdzv_id",
        args.rdzv_id,
        *([] if args.local_addr is None else ["--local_addr", args.local_addr]),
    ]
    return [*head, *nodes, "--nproc_per_node", str(per_node), *tail]


def _endpoint(text: str | None) -> str:
    """HOST:PORT checked; CliError when it is missing or not of that form."""
    if text is None:
        raise CliError(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every node: the address of one of the "
            "hosts and a free TCP port there (e.g. --rdzv-endpoint 10.0.0.1:29400)"
        )
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(
            f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.1:29400), found {text!r}"
        )
    return text
