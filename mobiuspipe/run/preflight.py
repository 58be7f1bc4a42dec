"""What a run checks before any work (its plan against the config and the job, its folders writable), and how
a mistake found at start-up is reported: one line per host, exit 2.

`mobiuspipe train` runs these checks before it starts torchrun (`launch_checks`), and every rank again at
start-up, before the process group exists (`rank_checks`). Every rank then finds the same mistakes from
the same config and files; `at_start_up()` marks them so that `report` prints them on the host's first
rank only while the other ranks exit quietly with the same code. Under `mobiuspipe train` (ERRORS_ENV set)
no rank prints one: each writes it into that folder, and `mobiuspipe train` prints it once, after torchrun
has stopped, and exits 2 (`start_up_error`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from foundation.checked import Problem, format_problems, rule
from foundation.errors import UserError
from mobiuspipe.config import RunConfig
from mobiuspipe.errors import ConfigError, PeerLostError
from mobiuspipe.run.resume import resume_root
from mobiuspipe.run.room import host_room, placements, shortfall_problem, ssd_need, ssd_room
from mobiuspipe.runtime.peers.ranks import local_world_size, rank_info
from mobiuspipe.startup.config_plan import (
    num_ranks,
    plan_from_config,
    plan_problems,
    replan_advice,
    with_run_workspaces,
)
from partition.plan import Plan, load_plan
from partition.rules.tiers import RunBudgetTooSmall

__all__ = [
    "check_writable",
    "launch_checks",
    "rank_checks",
    "at_start_up",
    "report",
    "start_up_error",
    "rank_mistake",
    "lost_peer",
    "USER_ERROR_EXIT",
    "ERRORS_ENV",
    "PLAN_ENV",
]

USER_ERROR_EXIT = 2
"""The exit code of a mistake the user can fix (a bug keeps Python's traceback and exit 1)."""
QUIET_WAIT_S = 10.0
"""How long a rank other than the host's first waits for that rank to report a start-up mistake (seconds)."""
PLAN_ENV = "MOBIUSPIPE_LAUNCH_PLAN"
"""The environment variable naming the plan `mobiuspipe train` made for its ranks (a config without plan.file): every
rank follows that one plan rather than make its own (a time-limited MIP could differ between them)."""
ERRORS_ENV = "MOBIUSPIPE_START_UP_ERRORS"
"""The environment variable naming the folder where ranks leave their mistakes for `mobiuspipe train` (a file
`rank{RANK}` each, holding the message, with a suffix of _KINDS)."""
_KINDS = ("", ".run", ".peer")
"""The suffixes of the files in the ERRORS_ENV folder: a start-up mistake, one found while the job ran, a lost
peer (PeerLostError)."""
_AT_START_UP = "_mobiuspipe_at_start_up"
"""The attribute at_start_up() sets on the errors it lets through."""


def check_writable(path: str | os.PathLike, key: str) -> Path:
    """Folder `path`, created (with its parents) if needed and proven writable by writing and removing a
    temporary file in it; ConfigError naming `key`, the path and the OS error otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".mobiuspipe-write-check-", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        failed = Path(os.fsdecode(e.filename)) if e.filename else folder
        where = f" (making {failed})" if failed in folder.parents else ""  # a parent folder it could not make
        raise ConfigError(
            f"{key}: expected a folder this process can create and write, found {folder}: "
            f"{e.strerror or e}{where}; fix: set {key} to a folder you can write, or make it writable "
            f"(permissions, free space, a read-write mount)"
        ) from e
    return folder


def launch_checks(cfg: RunConfig, nproc: int | None, nnodes: int = 1) -> tuple[int, Plan]:
    """What `mobiuspipe train` checks after `open_run` and before it starts torchrun: the plan (plan.file read
    and checked against the config, or made now, once for every rank: the launcher hands it to them through
    PLAN_ENV; on a CUDA host it reads the gpus through NVML and creates no CUDA context), --nproc against its gpu
    count, the plan's states against the memory settings (on one machine memory.ssd_dir too: across machines each
    host's ranks check their own), train.out_dir writable. Returns the number of ranks to start and the plan."""
    plan = _plan_file(cfg, None if nproc is None else (nproc, f"--nproc {nproc}")) or _made_plan(cfg, nnodes)
    _check_memory(cfg, plan, range(plan.num_gpus) if nnodes == 1 else None)
    _check_out_dir(cfg)
    return (plan.num_gpus if nproc is None else nproc), plan


def rank_checks(cfg: RunConfig) -> Plan:
    """What each rank checks after `open_run`, before the process group exists: the job's rank count
    (WORLD_SIZE) against the plan's gpus, the plan (plan.file against the config; else the one its launcher made,
    PLAN_ENV; else made now), the plan's states against the memory settings (memory.ssd_dir for the ranks of this
    host), train.out_dir writable. Returns the plan."""
    info = rank_info()
    how = f"torchrun started {info.world_size} (WORLD_SIZE)" if info.under_torchrun else "1, not started by torchrun"
    plan = _plan_file(cfg, (info.world_size, how)) or _handed_plan(cfg) or _made_plan(cfg)
    first = info.rank - info.local_rank  # torchrun numbers a host's ranks in a row
    _check_memory(cfg, plan, range(first, first + local_world_size(info.world_size)))
    _check_out_dir(cfg)
    return plan


def _check_memory(cfg: RunConfig, plan: Plan, host_ranks: range | None) -> None:
    """Every rank's stages under memory.host_budget_mb; then, for the ranks on this host (None: not known here),
    memory.ssd_dir writable and with room for what they put there, and this host's memory with room for what they
    hold there (mobiuspipe.run.room). Every problem at once."""
    placed, problems = placements(cfg, plan)
    need = 0 if problems or host_ranks is None else ssd_need(cfg, plan, placed, host_ranks)
    if need and host_ranks is not None:
        folder = check_writable(str(cfg.memory.ssd_dir), "memory.ssd_dir")
        problems += ssd_room(folder, need, host_ranks)
    if not problems and host_ranks is not None:
        problems += host_room(cfg, plan, placed, host_ranks)
    _raise(cfg, problems)


def _made_plan(cfg: RunConfig, hosts: int = 1) -> Plan:
    """The config's plan made now (mobiuspipe.startup.config_plan) for a job over `hosts` machines (the launcher's
    --nnodes; a rank reads its own host's ranks from torchrun); a memory.host_budget_mb that holds no rank's states
    is reported as the placement check reports it, every rank at once."""
    try:
        return plan_from_config(cfg, hosts=hosts)
    except RunBudgetTooSmall as e:
        _raise(cfg, [shortfall_problem(e.shortfalls, cfg.memory.host_budget_mb)])
        raise


def _handed_plan(cfg: RunConfig) -> Plan | None:
    """The plan `mobiuspipe train` made for its ranks (PLAN_ENV), None without it (a plain torchrun)."""
    path = os.environ.get(PLAN_ENV)
    return load_plan(path) if path and not cfg.plan.file else None


def _plan_file(cfg: RunConfig, job: tuple[int, str] | None) -> Plan | None:
    """plan.file's plan (its workspaces as the run's libraries hold them: with_run_workspaces), with every mismatch
    with the config and with the job's rank count reported at once
    (job: the ranks, and how they were asked for); without plan.file, None once the rank count fits the
    gpus the config plans for."""
    if cfg.plan.file:
        plan = load_plan(cfg.plan.file)
        _raise(cfg, _world_problems(cfg, plan.num_gpus, job) + plan_problems(plan, cfg))
        return with_run_workspaces(cfg, plan)
    _raise(cfg, _world_problems(cfg, num_ranks(cfg), job))
    return None


def _check_out_dir(cfg: RunConfig) -> None:
    """train.out_dir, and the checkpoint folder when checkpoints are written, writable; a named resume folder
    holding a finished checkpoint."""
    t = cfg.train
    if t.out_dir:
        check_writable(t.out_dir, "train.out_dir")
    if t.checkpoint_dir:
        check_writable(t.checkpoint_dir, "train.checkpoint_dir")
    named = t.resume if t.resume not in (None, "auto") and resume_root(t.resume, Path(".")) is None else None
    if named is not None and not (Path(named) / "complete").is_file():
        what = "a folder without its `complete` marker (never finished)" if Path(named).is_dir() else "no folder"
        raise ConfigError(
            f"train.resume: expected a checkpoint folder (OUT_DIR/checkpoints/step-N holding `complete`) or a run "
            f"folder holding checkpoints/, found {what} at {t.resume}; fix: name a step-N folder there, the run's "
            f"OUT_DIR, or use --resume auto for the newest"
        )


def _gpus_key(cfg: RunConfig) -> str:
    """The config key that sets the run's gpu count."""
    if cfg.plan.file:
        return "plan.file"
    return "plan.topology" if cfg.plan.topology else "plan.num_gpus"


def _world_problems(cfg: RunConfig, gpus: int, job: tuple[int, str] | None) -> list[Problem]:
    """The job's rank count against the plan's gpu count (none when the job is not known yet)."""
    if job is None:
        return []
    ranks, how = job
    if how.startswith("--nproc"):
        start = f"drop --nproc (mobiuspipe train then starts {gpus})"
    else:
        start = (
            f"start {gpus} ranks (`mobiuspipe train --config {cfg.source}` starts one per gpu; by hand, "
            f"`torchrun --nproc_per_node {gpus} ...` on one machine)"
        )
    fix = f"{start}, or {_replan_for(cfg, ranks)}"
    return rule(gpus == ranks, _gpus_key(cfg), f"{gpus} ranks, one per gpu of the plan", how, fix)


def _replan_for(cfg: RunConfig, ranks: int) -> str:
    """How to make the config's plan for `ranks` gpus."""
    key = _gpus_key(cfg)
    if key == "plan.num_gpus":
        return f"set plan.num_gpus: {ranks}"
    if key == "plan.topology":
        return f"plan for a machine of {ranks} gpus (plan.topology)"
    return f"set plan.num_gpus: {ranks} and " + replan_advice(cfg, f"for {ranks} gpus")


def _raise(cfg: RunConfig, problems: list[Problem]) -> None:
    if problems:
        raise ConfigError(format_problems(f"config {cfg.source}", problems))


@contextmanager
def at_start_up(kind: type[UserError] | tuple[type[UserError], ...] = UserError) -> Iterator[None]:
    """Marks the user errors (of `kind`) raised inside as start-up mistakes, which every rank finds alike (the
    same config and files, before any rank talks to another; or a mistake the ranks have agreed on, as in the
    checkpoint a run resumes from): `report` prints them once per host."""
    try:
        yield
    except kind as e:
        setattr(e, _AT_START_UP, True)
        raise


def report(e: UserError, prog: str) -> int:
    """Print `e` as one line on stderr (`PROG: error: ...`) and return the exit code 2. Under `mobiuspipe train`
    every mistake is written into its ERRORS_ENV folder instead (it prints the one that stopped the job, last).
    Under plain torchrun a start-up mistake (at_start_up) is printed by the host's first rank (LOCAL_RANK 0, or
    no launcher); another rank waits for it: when that rank exits, torchrun stops the others with SIGTERM, and
    this one exits 2 without a word. Only if that does not happen within QUIET_WAIT_S (the mistake is this
    rank's alone) does it print too."""
    at_start = getattr(e, _AT_START_UP, False)
    kind = _KINDS[0] if at_start else _KINDS[2] if isinstance(e, PeerLostError) else _KINDS[1]
    if _leave_for_launcher(str(e), kind):
        return USER_ERROR_EXIT
    if at_start and os.environ.get("LOCAL_RANK", "0") != "0":
        _await_first_rank()
    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def _leave_for_launcher(message: str, kind: str) -> bool:
    """Write a mistake into the ERRORS_ENV folder as rank{RANK}{kind} (temporary name, then rename); False
    without that folder, or when the write fails (the rank then prints the mistake itself)."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}{kind}"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(message)
        tmp.replace(path)
    except OSError:  # the launcher's folder is gone: say it here rather than not at all
        return False
    return True


def _mistakes(folder: Path, kinds: tuple[str, ...]) -> str | None:
    """The message of the first mistake the ranks left in `folder` (ERRORS_ENV) among `kinds`: by kind in that
    order, then the lowest rank; None when there is none."""
    found = {}
    for p in folder.iterdir() if folder.is_dir() else ():
        m = re.fullmatch(r"rank(\d+)(\.[a-z]+)?", p.name)
        if m and (m[2] or "") in kinds:
            found[(kinds.index(m[2] or ""), int(m[1]))] = p
    return found[min(found)].read_text() if found else None


def start_up_error(folder: Path) -> str | None:
    """The start-up mistake the ranks left in `folder` (ERRORS_ENV): the lowest rank's; None when none did.
    A restart of the job would fail the same way."""
    return _mistakes(folder, _KINDS[:1])


def rank_mistake(folder: Path) -> str | None:
    """The mistake that stopped the job: a start-up one, else one a rank found while it ran (not a lost peer,
    which follows another rank's end, a mistake or not)."""
    return _mistakes(folder, _KINDS[:2])


def lost_peer(folder: Path) -> str | None:
    """A rank's report that a peer stopped answering (PeerLostError), or None."""
    return _mistakes(folder, _KINDS[2:])


def _await_first_rank() -> None:
    """Sleep up to QUIET_WAIT_S; a SIGTERM meanwhile (torchrun stopping the job) exits with code 2."""

    def quietly(signum, frame) -> None:
        raise SystemExit(USER_ERROR_EXIT)

    previous = signal.signal(signal.SIGTERM, quietly)
    try:
        time.sleep(QUIET_WAIT_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
