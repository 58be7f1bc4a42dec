"""The `mobiuspipe` command: env, topology, partition, simulate, train (and profile); user errors exit 2."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

from foundation.errors import UserError
from mobiuspipe.cli_args import CliError, non_negative_float, positive_int
from mobiuspipe.cli_partition import run_partition

__all__ = ["main", "build_parser"]


def cmd_env(args: argparse.Namespace) -> int:
    from mobiuspipe.cli_env import collect_env, render_env

    d = collect_env()
    sys.stdout.write(json.dumps(d, indent=2) + "\n" if args.json else render_env(d))
    return 0


def _topology_of(args: argparse.Namespace):
    """The layout named by --layout, else this machine (or the sysfs copy at --sysfs-root), probed if asked."""
    from topology import load_topology, save_topology
    from topology.discover import discover

    t = load_topology(args.layout) if args.layout else discover(args.sysfs_root)
    if args.probe:
        from topology.probe import probe

        t = probe(t, args.ssd_dir, size_mb=args.probe_mb)
    if args.save:
        save_topology(t, args.save)
    return t


def cmd_topology(args: argparse.Namespace) -> int:
    from topology.report import render_matrix, render_text, render_tree, to_json_dict

    if args.layout and args.sysfs_root:
        raise CliError("--layout reads a saved or preset layout and --sysfs-root discovers one: give only one")
    t = _topology_of(args)
    if args.svg:  # before any output: a path that cannot be written leaves stdout empty
        from topology.report_svg import svg_topology

        svg_topology(t, args.svg)
    if args.json:
        sys.stdout.write(json.dumps(to_json_dict(t), indent=2) + "\n")
    else:
        sys.stdout.write(render_matrix(t) if args.matrix else render_tree(t) if args.tree else render_text(t))
    note_to = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON only
    for what, path in (("picture", args.svg), ("layout", args.save)):
        if path:
            print(f"{what} written to {path}", file=note_to)
    return 0


def _add_topology(sub) -> None:
    from topology.presets import PRESETS

    p = sub.add_parser("topology", help="gpus, PCIe tree, NVLinks and contention groups of a machine or layout")
    p.add_argument("--layout", metavar="NAME_OR_FILE",
                   help=f"preset ({', '.join(PRESETS)}) or a .yaml/.json layout file; default: discover this "
                        f"machine (NVML + sysfs)")
    p.add_argument("--sysfs-root", metavar="DIR", help="discover from a copy of /sys instead of the live one")
    p.add_argument("--save", metavar="FILE.yaml", help="write the topology as a layout file (.yaml or .json)")
    p.add_argument("--probe", action="store_true",
                   help="measure host<->GPU (alone and per contention group), GPU<->GPU and SSD bandwidth, "
                        "and write the numbers into the topology")
    p.add_argument("--ssd-dir", default=".", metavar="DIR", help="folder whose SSD --probe measures (.)")
    p.add_argument("--probe-mb", type=positive_int, default=256, metavar="MB",
                   help="MiB each --probe transfer moves (256)")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="print one JSON document (tree, groups, matrix, ...)")
    view.add_argument("--matrix", action="store_true", help="print only the nvidia-smi topo -m style matrix")
    view.add_argument("--tree", action="store_true", help="print only the lstopo-style tree")
    p.add_argument("--svg", metavar="FILE.svg", help="also draw the topology as an SVG picture")
    p.set_defaults(func=cmd_topology)


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
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="sequences per microbatch (1)")
    p.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per step (4)")
    p.add_argument("--stages", type=int, default=None,
                   help="number of stages S (gpus <= S <= layers); default: search every S, keep the fastest")
    p.add_argument("--mapping", choices=("cross", "round-robin", "search"), default="cross",
                   help="stage->gpu rule: cross (least contention), round-robin, search (every cyclic gpu order, "
                        "up to 4 gpus; the fastest wins) (cross)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="parameter dtype (fp16)")
    p.add_argument("--reserve-gib", type=non_negative_float, default=1.0,
                   help="GiB of each gpu kept out of the plan for the CUDA context and allocator (1.0)")
    p.add_argument("--solver", choices=("auto", "highs", "gurobi", "dp"), default="auto",
                   help="auto: Gurobi when its license admits the model, else HiGHS; dp: the exact DP alone (auto)")
    p.add_argument("--time-limit", type=non_negative_float, default=2.0, metavar="S",
                   help="seconds the MIP may take in all; on a time-out the best plan found is kept with its gap (2)")
    p.add_argument("--gap", type=non_negative_float, default=0.01,
                   help="relative MIP gap to stop at (0.01 = 1%%)")
    p.add_argument("--profile", metavar="FILE",
                   help="use this profile (from `mobiuspipe profile -o`) instead of the analytic one of --model")
    p.add_argument("--compare", action="store_true",
                   help="also predict sequential mapping, DeepSpeed ZeRO-3 offload and GPipe on the same topology")
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
    _add_topology(sub)
    _add_partition(sub)
    from mobiuspipe.cli_profile import register as add_profile
    from mobiuspipe.cli_simulate import register as add_simulate

    add_profile(sub)
    add_simulate(sub)
    p = sub.add_parser("train", help="launch torchrun on a YAML run config")
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks to start (default: the plan's gpu count)")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:  # anything else is a bug: keep the traceback
        print(f"mobiuspipe: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
