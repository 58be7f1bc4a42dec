"""Token files in nanoGPT's layout (token ids as raw little-endian uint16 or uint32, no header) and text read as
bytes, both through a memory map; the checks every token source shares."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from foundation.loader import Problem
from mobiuspipe.errors import ConfigError

__all__ = ["Vocabulary", "data_error", "unreadable", "open_token_file", "open_bytes", "check_ids", "write_token_file"]


def data_error(key: str, expected: str, found: str, fix: str) -> ConfigError:
    """A ConfigError about data named by config key `key`: "key: expected ..., found ...; fix: ..."."""
    return ConfigError(str(Problem(key, expected, found, fix)))


def unreadable(key: str, path: str, err: OSError) -> ConfigError:
    """The ConfigError for a data file (named by config key `key`) that cannot be read."""
    return data_error(
        key, "a readable file", f"{path}: {err.strerror or err}", f"check {key} and the file's permissions"
    )


def _size(path: str, key: str) -> int:
    """The bytes of a readable file; ConfigError when it cannot be opened."""
    try:
        with open(path, "rb"):
            return os.path.getsize(path)
    except OSError as e:
        raise unreadable(key, path, e) from e


def _map(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    """The file's `count` items of `dtype`, mapped read-only (an empty array for an empty file)."""
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def open_token_file(path: str, token_dtype: str, key: str) -> np.ndarray:
    """The token ids of a token file of `token_dtype` ("uint16" or "uint32"; "uint8" for an examples file's mask),
    memory-mapped, never read whole."""
    size, item = _size(path, key), np.dtype(token_dtype).itemsize
    if size % item:
        other = "uint32" if token_dtype == "uint16" else "uint16"
        raise data_error(
            key,
            f"a token file of {token_dtype} ids, {item} bytes each (data.token_dtype)",
            f"{path} of {size:,} bytes, not a multiple of {item} ({size % item} left over)",
            f"check data.token_dtype (is it {other}?) or rewrite the file with `mobiuspipe tokenize`",
        )
    tokens = _map(path, np.dtype(token_dtype).newbyteorder("<"), size // item)
    if token_dtype == "uint16" and _looks_wide(tokens):
        raise data_error(
            key,
            "a token file of uint16 ids (data.token_dtype)",
            f"{path}, where every second id is at most {WIDE_HALF} in its first {min(len(tokens), WIDTH_SAMPLE):,} "
            f"uint16 values, as in uint32 ids below {(WIDE_HALF + 1) << 16:,} read two bytes at a time",
            "set data.token_dtype: uint32 (the file's ids are 4 bytes each)",
        )
    return tokens


WIDTH_SAMPLE = 8192
"""uint16 values of a token file's start that _looks_wide reads."""


WIDE_HALF = 3
"""The largest upper half of a uint32 id _looks_wide takes: ids below 262,144 (Gemma's vocabulary; Llama 3's 128,256
gives 0 and 1, and starts each document with 128,000, upper half 1)."""


def _looks_wide(tokens: np.ndarray) -> bool:
    """Whether uint16 `tokens` are uint32 ids read two bytes at a time: every odd value of the first WIDTH_SAMPLE at
    most WIDE_HALF (their upper halves) and some even one above it (at least 64 values: text whose every second token
    is one of the ids 0 to 3, the special tokens, is not text)."""
    head = np.asarray(tokens[: min(len(tokens), WIDTH_SAMPLE) // 2 * 2])
    return len(head) >= 64 and int(head[1::2].max()) <= WIDE_HALF and int(head[0::2].max()) > WIDE_HALF


def open_bytes(path: str, key: str) -> np.ndarray:
    """A text file's bytes as token ids 0..255, memory-mapped."""
    return _map(path, np.dtype(np.uint8), _size(path, key))


@dataclass(frozen=True)
class Vocabulary:
    """The model's vocabulary: its size, and whether the run config sets it (the built-in GPT's model.vocab_size)
    or the model does (a Hugging Face model's config.json), which decides the advice for ids beyond it."""

    size: int
    from_model: bool = False

    def fix(self, need: int) -> str:
        """What to do about ids (or a tokenizer) that need `need` ids."""
        if self.from_model:
            return (
                f"use the model's own tokenizer (data.tokenizer: the model's folder) or data made with it: a Hugging "
                f"Face model's vocabulary is its config.json's vocab_size ({self.size}), not model.vocab_size"
            )
        return f"raise model.vocab_size to at least {need}, or use data made with the model's own tokenizer"


def check_ids(tokens: np.ndarray, vocab: Vocabulary, key: str, what: str, token_dtype: str | None = None) -> None:
    """Every id of `tokens` (from `what`; read as `token_dtype` from a token file) must be below the model's
    vocabulary size."""
    top = int(tokens.max()) if len(tokens) else -1
    if top >= vocab.size:
        narrow = token_dtype == "uint32" and top >= 1 << 16 and vocab.size <= 1 << 16  # two uint16 ids read as one
        raise data_error(
            key,
            f"token ids below the model's vocab_size {vocab.size}",
            f"ids up to {top} in {what}",
            "set data.token_dtype: uint16 (the file's ids look 2 bytes each), or " + vocab.fix(top + 1)
            if narrow
            else vocab.fix(top + 1),
        )


def write_token_file(chunks: Iterable[np.ndarray], path: str, token_dtype: str) -> int:
    """Write the ids of every chunk to `path` as `token_dtype` (nanoGPT's layout), through a temporary file
    renamed at the end; the number of tokens written. ValueError when an id does not fit the dtype;
    OSError when the file cannot be written."""
    dtype = np.dtype(token_dtype).newbyteorder("<")
    limit = int(np.iinfo(dtype).max)
    tmp, count = f"{path}.tmp", 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                if len(chunk) and int(chunk.max()) > limit:
                    raise ValueError(f"token id {int(chunk.max())} does not fit {token_dtype} (at most {limit})")
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                count += len(chunk)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return count
