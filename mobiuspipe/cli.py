"""The `mobiuspipe` command: env, topology, partition and train; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

from mobiuspipe.cli_partition import CliError, run_partition

__all__ = ["main", "build_parser", "user_errors"]


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a user can fix: one line on stderr and exit code 2 instead of a traceback."""
    from mobiuspipe.train import USER_ERRORS  # imports torch: only paid when something failed
    from partition.errors import UnknownModelError

    return (*USER_ERRORS, UnknownModelError, CliError)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {text!r}")
    return value


def cmd_env(args: argparse.Namespace) -> int:
    from mobiuspipe.cli_env import collect_env, render_env

    d = collect_env()
    sys.stdout.write(json.dumps(d, indent=2) + "\n" if args.json else render_env(d))
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from topology import load_topology
    from topology.report import render_text, to_json_dict

    t = load_topology(args.layout)
    sys.stdout.write(json.dumps(to_json_dict(t), indent=2) + "\n" if args.json else render_text(t))
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    return run_partition(args, sys.stdout)


def _plan_gpus(config) -> int:
    """Ranks to launch: the plan file's gpu count when the config names one, else plan.num_gpus."""
    if config.plan.file:
        from partition.plan import load_plan

        return load_plan(config.plan.file).num_gpus
    return config.plan.num_gpus


def cmd_train(args: argparse.Namespace) -> int:
    from mobiuspipe.config import load_config

    config = load_config(args.config)  # a bad config fails here, before any process starts
    nproc = args.nproc or _plan_gpus(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           "-m", "mobiuspipe.train", "--config", config.source]
    print(f"mobiuspipe: launching {shlex.join(cmd)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return subprocess.run(cmd, check=False).returncode  # the children write straight to our stdout/stderr


def _add_partition(sub) -> None:
    p = sub.add_parser("partition", help="cut a model into stages, map them to gpus and predict the step")
    p.add_argument("--model", help="model name, e.g. gpt3-175b (an unknown name lists them all)")
    p.add_argument("--topology", help='preset name ("2+2", "3+1") or a .yaml/.json layout file')
    p.add_argument("--config", metavar="RUN.yaml",
                   help="plan a training run's model on its devices instead (then write it with -o for plan.file)")
    p.add_argument("--microbatch-size", type=_positive_int, default=1, help="sequences per microbatch (1)")
    p.add_argument("--microbatches", type=_positive_int, default=4, help="microbatches per step (4)")
    p.add_argument("--stages", type=int, default=None,
                   help="number of stages S (gpus <= S <= layers); default: search every S, keep the fastest")
    p.add_argument("--mapping", choices=("cross", "round-robin"), default="cross", help="stage->gpu rule (cross)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="parameter dtype (fp16)")
    p.add_argument("--reserve-gib", type=_non_negative_float, default=1.0,
                   help="GiB of each gpu kept out of the plan for the CUDA context and allocator (1.0)")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan here (.yaml, or .json by suffix)")
    p.add_argument("--timeline", metavar="FILE.svg", help="write an SVG Gantt chart of the predicted step")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(func=cmd_partition)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mobiuspipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("env", help="versions, solvers, CUDA, NVML and CPU threads of this machine")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("topology", help="gpus, root complexes and contention groups of a layout")
    p.add_argument("--layout", default="2+2", help='preset name ("2+2", "3+1") or a .yaml/.json layout file')
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_topology)
    _add_partition(sub)
    p = sub.add_parser("train", help="launch torchrun on a YAML run config")
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks to start (default: the plan's gpu count)")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        if not isinstance(e, user_errors()):
            raise  # a bug: keep the traceback
        print(f"mobiuspipe: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
