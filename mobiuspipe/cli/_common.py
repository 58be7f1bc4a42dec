"""Pieces every CLI subcommand shares: argument types, the user-error class, writing an output file."""

from __future__ import annotations

import argparse

from foundation.errors import UserError
from partition.report.trace import RenderError

__all__ = ["CliError", "positive_int", "non_negative_float", "ranks_per_node", "write_output"]


class CliError(UserError, ValueError):
    """A command-line value the command cannot use (an unknown GPU name, an unwritable output path)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {text!r}")
    return value


def ranks_per_node(nproc: int, nnodes: int) -> int:
    """Ranks each node starts; CliError unless nnodes divides nproc."""
    if nproc % nnodes:
        fits = [n for n in range(1, nproc + 1) if nproc % n == 0]
        raise CliError(
            f"the plan has {nproc} gpus (ranks), which --nnodes {nnodes} does not divide ({nproc} % {nnodes} = "
            f"{nproc % nnodes}): every node starts the same number of ranks; use --nnodes "
            f"{' / '.join(map(str, fits))}, or plan for a multiple of {nnodes} gpus (plan.num_gpus)"
        )
    return nproc // nnodes


def write_output(what: str, path: str, write) -> None:
    """Run write(); an OS or rendering failure becomes one CliError naming the file."""
    try:
        write()
    except OSError as e:
        raise CliError(
            f"cannot write the {what} to {path}: {e.strerror or e}; "
            f"expected a writable file path (does its folder exist?)"
        ) from e
    except RenderError as e:
        raise CliError(str(e)) from e
