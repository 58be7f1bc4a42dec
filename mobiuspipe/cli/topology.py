"""`mobiuspipe topology`: gpus, PCIe tree, NVLinks and contention groups of this machine or a layout."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

from mobiuspipe.cli._common import CliError, positive_int

__all__ = ["register", "run"]


def register(sub) -> None:
    """Add the `topology` subcommand to the CLI's subparsers."""
    from topology.presets import PRESETS

    p = sub.add_parser("topology", help="gpus, PCIe tree, NVLinks and contention groups of a machine or layout")
    p.add_argument(
        "--layout",
        metavar="NAME_OR_FILE",
        help=f"preset ({', '.join(PRESETS)}) or a .yaml/.json layout file; default: discover this "
        f"machine (NVML + sysfs)",
    )
    p.add_argument("--sysfs-root", metavar="DIR", help="discover from a copy of /sys instead of the live one")
    p.add_argument("--save", metavar="FILE.yaml", help="write the topology as a layout file (.yaml or .json)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="measure host<->GPU (alone and per contention group), GPU<->GPU and SSD bandwidth, "
        "and write the numbers into the topology",
    )
    p.add_argument("--ssd-dir", default=".", metavar="DIR", help="folder whose SSD --probe measures (.)")
    p.add_argument(
        "--probe-mb", type=positive_int, default=256, metavar="MB", help="MiB each --probe transfer moves (256)"
    )
    view = p.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="print one JSON document (tree, groups, matrix, ...)")
    view.add_argument("--matrix", action="store_true", help="print only the nvidia-smi topo -m style matrix")
    view.add_argument("--tree", action="store_true", help="print only the lstopo-style tree")
    p.add_argument("--svg", metavar="FILE.svg", help="also draw the topology as an SVG picture")
    p.set_defaults(func=run)


def _topology_of(args: argparse.Namespace):
    """The layout named by --layout, else this machine (or the sysfs copy at --sysfs-root), probed if asked."""
    from topology import load_topology, save_topology
    from topology.discover import discover

    t = load_topology(args.layout) if args.layout else discover(args.sysfs_root)
    if args.probe:
        from mobiuspipe.optim.adam_rate import probe_rank_adam
        from mobiuspipe.optim.host_threads import rank_threads
        from topology.probe import probe

        # the update as the ranks run it: each its share of the cores, all at once; params as large as the transfers
        adam = partial(
            probe_rank_adam, ranks=t.num_gpus, threads=rank_threads(None, t.num_gpus), params=args.probe_mb * 2**18
        )
        t = probe(t, args.ssd_dir, size_mb=args.probe_mb, host_adam=adam)
    if args.save:
        save_topology(t, args.save)
    return t


def run(args: argparse.Namespace, out) -> int:
    """Find (and probe, save, draw) the topology; print the report or the JSON document on `out`."""
    from topology.report import render_matrix, render_text, render_tree, to_json_dict

    if args.layout and args.sysfs_root:
        raise CliError("--layout reads a saved or preset layout and --sysfs-root discovers one: give only one")
    t = _topology_of(args)
    if args.svg:  # before any output: a path that cannot be written leaves stdout empty
        from topology.report_svg import svg_topology

        svg_topology(t, args.svg)
    if args.json:
        out.write(json.dumps(to_json_dict(t), indent=2) + "\n")
    else:
        out.write(render_matrix(t) if args.matrix else render_tree(t) if args.tree else render_text(t))
    note_to = sys.stderr if args.json else out  # --json: stdout holds the JSON only
    for what, path in (("picture", args.svg), ("layout", args.save)):
        if path:
            print(f"{what} written to {path}", file=note_to)
    return 0
