"""Text and JSONL documents tokenized with a local Hugging Face tokenizer folder, each document followed by the
tokenizer's end-of-text token.

A document is a whole text file, or the `field` string of one JSONL line (blank lines are skipped). It is
encoded as the tokenizer encodes by default (its post-processor may put a BOS token first, as Llama's does),
then followed by the end-of-text token unless it already ends with it. The end-of-text token is
tokenizer_config.json's eos_token; without one, the first of EOS_CANDIDATES the tokenizer knows; without any,
documents follow each other with nothing between them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from foundation.host_memory import mem_available
from foundation.units import fmt_bytes
from mobiuspipe.config.data import is_jsonl
from mobiuspipe.data.hf_datasets import dataset_records, is_dataset_folder
from mobiuspipe.data.token_file import data_error, unreadable

__all__ = ["TextTokenizer", "load_tokenizer", "read_documents", "token_chunks", "tokenize_file", "EOS_CANDIDATES"]

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text tokens looked for when tokenizer_config.json names none (GPT-2, Llama 3, Llama 2, Gemma)."""
DOCS_PER_CHUNK = 512
"""JSONL documents encoded together (encode_batch runs them on every core)."""


@dataclass(frozen=True)
class TextTokenizer:
    """A tokenizer read from a folder, with the end-of-text token that ends each document (None: no such token)."""

    tokenizer: Tokenizer
    folder: str
    eos_token: str | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int:
        """Token ids it can produce: its largest id + 1, added tokens included."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def describe(self) -> str:
        """E.g. "tokenizer /m (eos <|endoftext|> = 50256)"."""
        eos = f"eos {self.eos_token} = {self.eos_id}" if self.eos_token else "no end-of-text token"
        return f"tokenizer {self.folder} ({eos})"

    def encode(self, documents: list[str]) -> np.ndarray:
        """The ids of `documents`, each followed by the end-of-text token, as one array."""
        parts = []
        for enc in self.tokenizer.encode_batch(documents):
            ids = enc.ids
            if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
                ids = [*ids, self.eos_id]
            parts.append(np.asarray(ids, dtype=np.uint32))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


def _read_json(path: str, key: str) -> dict:
    """A JSON object file; ConfigError naming it when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise data_error(key, "a readable JSON file", f"{path}: {e}", "rewrite it with save_pretrained") from e
    if not isinstance(data, dict):
        raise data_error(key, "a JSON object", f"{path}: {type(data).__name__}", "rewrite it with save_pretrained")
    return data


def _eos(tokenizer: Tokenizer, folder: str, key: str) -> str | None:
    """The end-of-text token: tokenizer_config.json's eos_token, else a known one the tokenizer has."""
    config_path = os.path.join(folder, "tokenizer_config.json")
    named = _read_json(config_path, key).get("eos_token") if os.path.isfile(config_path) else None
    if isinstance(named, dict):  # older files write an AddedToken: {"content": "</s>", ...}
        named = named.get("content")
    if isinstance(named, str):
        if tokenizer.token_to_id(named) is None:
            raise data_error(
                key,
                "an eos_token that tokenizer.json has",
                f"{config_path} names {named!r}, which {folder}/tokenizer.json does not know",
                "write both files with the same save_pretrained call",
            )
        return named
    return next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


def load_tokenizer(folder: str, key: str = "data.tokenizer") -> TextTokenizer:
    """The tokenizer of `folder` (tokenizer.json, as save_pretrained writes it) and its end-of-text token."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise data_error(
            key,
            "a folder holding tokenizer.json (a fast tokenizer, as save_pretrained writes it)",
            f"{folder} without tokenizer.json",
            "point it at the model's folder, or save one with AutoTokenizer.from_pretrained(...).save_pretrained(DIR)",
        )
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the Rust loader raises a bare Exception for a malformed file
        raise data_error(key, "a tokenizer.json the tokenizers library reads", f"{path}: {e}", "save it again") from e
    tokenizer.no_truncation()  # a saved max_length would cut every document short; packing needs no padding
    tokenizer.no_padding()
    eos = _eos(tokenizer, folder, key)
    return TextTokenizer(tokenizer, folder, eos, None if eos is None else tokenizer.token_to_id(eos))


def _jsonl_documents(path: str, field: str, key: str) -> Iterator[str]:
    """The `field` string of each non-blank line; ConfigError naming the file and line of a bad one."""
    fix = f"fix line {{n}} of {path}, or set data.field (--field) to the key that holds each document's text"
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise data_error(key, "one JSON object per line", f"line {n} of {path}: {e}", fix.format(n=n)) from e
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise data_error(
                    key, f"a {field!r} key (data.field) in every line", f"line {n} of {path}: {keys}", fix.format(n=n)
                )
            if not isinstance(record[field], str):
                found = f"line {n} of {path}: {field!r} holds {type(record[field]).__name__}"
                raise data_error(key, f"a string under {field!r}", found, fix.format(n=n))
            yield record[field]


ENCODING_BYTES_PER_TOKEN = 415
"""Host memory the tokenizers library's Encoding takes per token of one document (ids, tokens, offsets, masks): the
peak resident set grew 1,145 MiB for the 2.89M tokens of 8 MB of text (scripts/bench_tokenize_memory.py, this
project's 2-core VM, 2026-11-29; BENCHMARKS.md)."""
TEXT_BYTES_PER_TOKEN = 4
"""Bytes of text a token takes, about (English under a BPE vocabulary; the estimate of a text file's tokens)."""


def _check_encoding_room(path: str, key: str) -> None:
    """ConfigError when a text file's one document, tokenized whole, needs more memory than MemAvailable."""
    size, free = os.path.getsize(path), mem_available()
    need = size // TEXT_BYTES_PER_TOKEN * ENCODING_BYTES_PER_TOKEN
    if free is not None and need > free:
        raise data_error(
            key,
            "a text file whose one document the tokenizer can hold in memory",
            f"{path} of {fmt_bytes(size)}: tokenized whole it takes about {fmt_bytes(need)} (some "
            f"{ENCODING_BYTES_PER_TOKEN} bytes a token), and {fmt_bytes(free)} is available",
            'split it into documents: JSONL with one {"text": ...} a line, tokenized a few hundred at a time',
        )


def _text_document(path: str, key: str) -> str:
    """A whole text file, decoded as UTF-8 (OSError when it cannot be read); refused first when tokenizing it as one
    document would take more memory than the host has available (the process would be killed without a word)."""
    _check_encoding_room(path, key)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        found = f"{path}, not UTF-8 at byte {e.start:,}"
        raise data_error(key, "UTF-8 text", found, "convert it, e.g. `iconv -t UTF-8`") from e


def _dataset_documents(path: str, field: str, key: str, split: str) -> Iterator[str]:
    """The `field` string of each row of a datasets folder (its `split`)."""
    for row, where in dataset_records(path, split, key):
        if not isinstance(row.get(field), str):
            found = f"{where}: {field!r} holds {type(row.get(field)).__name__}; its columns: {', '.join(row)}"
            raise data_error(key, f"a string column {field!r} (data.field)", found, "set data.field (--field)")
        yield row[field]


def read_documents(path: str, field: str, key: str, split: str = "train") -> Iterator[str]:
    """The documents of a file: each JSONL line's `field` (a name ending .jsonl), each row's `field` of a datasets
    folder (its `split`), else the whole text."""
    if is_dataset_folder(path):
        yield from _dataset_documents(path, field, key, split)
        return
    try:
        if is_jsonl(path):
            yield from _jsonl_documents(path, field, key)
        else:
            yield _text_document(path, key)
    except OSError as e:
        raise unreadable(key, path, e) from e


def token_chunks(tok: TextTokenizer, path: str, field: str, key: str, split: str = "train") -> Iterator[np.ndarray]:
    """The ids of `path`'s documents, a few hundred documents at a time (uint32)."""
    batch: list[str] = []
    for doc in read_documents(path, field, key, split):
        batch.append(doc)
        if len(batch) == DOCS_PER_CHUNK:
            yield tok.encode(batch)
            batch = []
    if batch:
        yield tok.encode(batch)


def tokenize_file(tok: TextTokenizer, path: str, field: str, key: str, split: str = "train") -> np.ndarray:
    """Every id of `path`'s documents in one array (uint32)."""
    chunks = list(token_chunks(tok, path, field, key, split))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint32)
