"""`mobiuspipe tokenize`: text or JSONL tokenized once with a local tokenizer folder into a token file (nanoGPT's
.bin layout) that `data.tokens` reads through a memory map; instruction examples (--format instruction) into an
examples file, rows of seq_len + 1 ids and their mask (mobiuspipe/data/instruct.py)."""

from __future__ import annotations

import argparse
import json
import os

from mobiuspipe.cli._common import CliError, write_output
from mobiuspipe.config.data import TOKEN_DTYPES
from mobiuspipe.data.hf_datasets import is_dataset_folder
from mobiuspipe.data.instruct import IGNORE, encode, load_chat_tokenizer, mask_path, read_examples, to_rows, write_rows
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
    p.add_argument(
        "--split",
        default="train",
        help="the split of a datasets folder that holds several (default: train; e.g. validation for a held-out file)",
    )
    p.add_argument(
        "--format",
        choices=("text", "instruction"),
        default="text",
        help="text: documents into one stream of ids (default); instruction: JSONL examples (messages, or prompt "
        "and response), one per row of --seq-len + 1 ids, with FILE.mask.bin marking the trained targets",
    )
    p.add_argument("--seq-len", type=int, help="with --format instruction: the model.seq_len the rows are cut to")
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
    if args.format == "instruction":
        return _instructions(args, out)
    if args.seq_len is not None:
        raise CliError("--seq-len: rows are for --format instruction; text is one stream: drop --seq-len")
    counts: list[int] = []

    def write() -> None:
        def chunks():
            for path in args.input:
                counts.append(0)
                for chunk in token_chunks(tok, path, args.field, "--input", args.split):
                    counts[-1] += len(chunk)
                    yield chunk

        write_token_file(chunks(), args.output, args.dtype)

    write_output("token file", args.output, write)
    report = {
        "output": os.path.abspath(args.output),
        "tokens": sum(counts),
        "dtype": args.dtype,
        "split": args.split,
        "inputs": [{"path": os.path.abspath(p), "tokens": n} for p, n in zip(args.input, counts)],
        "tokenizer": os.path.abspath(tok.folder),
        "vocab_size": tok.vocab_size,
        "eos_token": tok.eos_token,
    }
    if args.json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print(
            f"wrote {report['tokens']:,} tokens ({args.dtype}) from {len(counts)} file(s){_split_words(args)} to "
            f"{report['output']} with {tok.describe()}; train on it with `data: {{tokens: {args.output}, token_dtype: "
            f"{args.dtype}}}`",
            file=out,
        )
    return 0


def _split_words(args: argparse.Namespace) -> str:
    """ " (split S)" where an input is a datasets folder (the split read of one that holds several), else nothing."""
    return f" (split {args.split})" if any(is_dataset_folder(p) for p in args.input) else ""


def _instructions(args: argparse.Namespace, out) -> int:
    """Instruction examples into an examples file (rows and mask); print what was written."""
    if args.seq_len is None or args.seq_len < 1:
        raise CliError(
            f"--seq-len: expected the model.seq_len the examples are cut to (>= 1) with --format instruction, found "
            f"{args.seq_len}; fix: give e.g. --seq-len 2048"
        )
    tok = load_chat_tokenizer(args.tokenizer, "--tokenizer")
    examples = [
        encode(tok, record, where)
        for path in args.input
        for record, where in read_examples(path, "--input", args.split)
    ]
    rows, targets, dropped = to_rows(examples, args.seq_len, tok.pad_id)
    write_output("examples file", args.output, lambda: write_rows(rows, targets, args.output, args.dtype))
    report = {
        "output": os.path.abspath(args.output),
        "mask": os.path.abspath(mask_path(args.output)),
        "examples": len(rows),
        "dropped": dropped,
        "seq_len": args.seq_len,
        "trained_targets": int((targets != IGNORE).sum()),
        "dtype": args.dtype,
        "tokenizer": os.path.abspath(tok.folder),
    }
    if args.json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print(
            f"wrote {len(rows):,} instruction examples ({dropped:,} dropped: no response within seq_len + 1) of "
            f"{args.seq_len} + 1 ids to {report['output']} and its mask {report['mask']}; train on them with "
            f"`data: {{format: instruction, tokens: {args.output}, token_dtype: {args.dtype}}}`",
            file=out,
        )
    return 0
