"""`mobiuspipe tokenize`: text or JSONL tokenized once with a local tokenizer folder into a token file (nanoGPT's
.bin layout) that `data.tokens` reads through a memory map."""

from __future__ import annotations

import argparse
import json
import os

from mobiuspipe.cli._common import CliError, write_output
from mobiuspipe.config.data import TOKEN_DTYPES
from mobiuspipe.data.token_file import write_token_file
from mobiuspipe.data.tokenizer import TextTokenizer, load_tokenizer, token_chunks

__all__ = ["register", "run"]


def register(sub) -> None:
    """Add the `tokenize` subcommand to the CLI's subparsers."""
    p = sub.add_parser("tokenize", help="tokenize text or JSONL into a token file for data.tokens")
    p.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json (as save_pretrained writes it)")
    p.add_argument(
        "--input",
        required=True,
        action="append",
        help="text file (one document) or .jsonl file (one document per line); repeat to concatenate several",
    )
    p.add_argument("--field", default="text", help="JSONL key holding each document's text (default: text)")
    p.add_argument("-o", "--output", required=True, help="token file to write, e.g. train.bin")
    p.add_argument("--dtype", choices=list(TOKEN_DTYPES), default="uint16", help="token id type (default: uint16)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the summary line")
    p.set_defaults(func=run)


def _check_dtype(tok: TextTokenizer, dtype: str) -> None:
    """The tokenizer's ids must fit the token file's integer type."""
    limit = 1 << (8 * TOKEN_DTYPES[dtype])
    if tok.vocab_size > limit:
        raise CliError(
            f"--dtype: expected a type that holds every id of {tok.folder}/tokenizer.json, found {dtype} (ids below "
            f"{limit:,}) for {tok.vocab_size:,} ids; fix: use --dtype uint32 (and data.token_dtype: uint32)"
        )


def run(args: argparse.Namespace, out) -> int:
    """Tokenize every input in turn into one token file; print what was written."""
    tok = load_tokenizer(args.tokenizer, "--tokenizer")
    _check_dtype(tok, args.dtype)
    counts: list[int] = []

    def write() -> None:
        def chunks():
            for path in args.input:
                counts.append(0)
                for chunk in token_chunks(tok, path, args.field, "--input"):
                    counts[-1] += len(chunk)
                    yield chunk

        write_token_file(chunks(), args.output, args.dtype)

    write_output("token file", args.output, write)
    report = {
        "output": os.path.abspath(args.output),
        "tokens": sum(counts),
        "dtype": args.dtype,
        "inputs": [{"path": os.path.abspath(p), "tokens": n} for p, n in zip(args.input, counts)],
        "tokenizer": os.path.abspath(tok.folder),
        "vocab_size": tok.vocab_size,
        "eos_token": tok.eos_token,
    }
    if args.json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print(
            f"wrote {report['tokens']:,} tokens ({args.dtype}) from {len(counts)} file(s) to {report['output']} with "
            f"{tok.describe()}; train on it with `data: {{tokens: {args.output}, token_dtype: {args.dtype}}}`",
            file=out,
        )
    return 0
