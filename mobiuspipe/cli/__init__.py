"""The `mobiuspipe` command: env, topology, partition, simulate, tokenize, train, export (and profile).

User errors exit 2.

Each subcommand is one module here with the same two functions: `register(sub)` adds its parser to the
subparsers and sets `func` to the module's `run(args, out) -> exit code`, which prints its report (or
its --json document) on `out`. Shared pieces (argument types, write_output, CliError) are in _common.
"""

from __future__ import annotations

import argparse
import sys

from foundation.errors import UserError
from mobiuspipe.cli import env, export, partition, profile, simulate, tokenize, topology, train

__all__ = ["main", "build_parser"]

SUBCOMMANDS = (env, topology, partition, profile, simulate, tokenize, train, export)
"""The subcommand modules, in the order `mobiuspipe --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mobiuspipe", description=(__doc__ or "").partition("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, sys.stdout)
    except UserError as e:  # anything else is a bug: keep the traceback
        print(f"mobiuspipe: error: {e}", file=sys.stderr, flush=True)
        return 2
