"""`mobiuspipe train`: check a YAML run config and its data, then launch torchrun with one rank per planned gpu."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from mobiuspipe.cli._common import positive_int

__all__ = ["register", "run"]


def register(sub) -> None:
    """Add the `train` subcommand to the CLI's subparsers."""
    p = sub.add_parser("train", help="launch torchrun on a YAML run config")
    p.add_argument("--config", required=True, help="YAML run config (see examples/tiny-gpt.yaml)")
    p.add_argument("--nproc", type=positive_int, default=None, help="ranks to start (default: the plan's gpu count)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out) -> int:
    """Run torchrun; its ranks write straight to this process's stdout and stderr (`out` is flushed first)."""
    from mobiuspipe.config import load_config
    from mobiuspipe.dataset import open_data, open_eval

    config = load_config(args.config)  # a bad config or bad data fails here, before any process starts
    open_data(config.data, config.model.seq_len, config.train.seed, config.model.vocab_size)
    open_eval(config.data, config.model.seq_len, config.model.vocab_size)
    if args.nproc is None:
        from mobiuspipe.config_plan import num_ranks

        nproc = num_ranks(config)
    else:
        nproc = args.nproc
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        "-m",
        "mobiuspipe.train",
        "--config",
        config.source,
    ]
    print(f"mobiuspipe: launching {shlex.join(cmd)}", file=sys.stderr, flush=True)
    out.flush()
    return subprocess.run(cmd, check=False).returncode
