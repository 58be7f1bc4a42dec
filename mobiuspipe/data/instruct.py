"""Instruction data: JSONL examples of a conversation (`messages`, rendered with the tokenizer folder's chat
template) or a `prompt` and its `response`, tokenized with the loss on the response tokens alone, one example per
sequence.

The rules (T = seq_len):
- messages: [{"role": ..., "content": ...}, ...], rendered by transformers' apply_chat_template with the
  tokenizer folder's template. The tokens each message adds to the rendering of the messages before it are that
  message's; an assistant message's tokens are trained, every other token is not. A template whose rendering of
  the first k messages is not a prefix of the rendering of k + 1 is refused (the tokens could not be told apart).
- prompt/response: the prompt encoded as the tokenizer encodes by default (a BOS first where it adds one), then
  the response without special tokens, then the end-of-text token; the response and the end-of-text token are
  trained.
- Each example is one sequence: its first T + 1 tokens (a longer example is cut), padded after its end with the
  end-of-text token (or id 0) to T + 1; inputs are the first T, targets the last T, and a target that is not
  trained (prompt, other roles, padding) is IGNORE, which the loss leaves out. Attention is causal, so the padding
  after an example changes nothing of it and no attention crosses examples. An example with no trained target
  left after the cut is dropped (counted in the description).
- The loss of a microbatch is the mean over its trained targets (torch's cross_entropy with ignore_index).

Tokenized once (`mobiuspipe tokenize --format instruction --seq-len T`), the examples are two files: FILE.bin
holds the rows of T + 1 ids (a token file: N (T + 1) ids of its dtype, no header) and FILE.mask.bin one byte per
target, N T of them, 1 where the target trains; N and T follow from the two sizes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mobiuspipe.data.hf_datasets import dataset_records, is_dataset_folder
from mobiuspipe.data.token_file import data_error, open_token_file, unreadable, write_token_file
from mobiuspipe.data.tokenizer import load_tokenizer

__all__ = [
    "IGNORE",
    "ChatTokenizer",
    "Example",
    "load_chat_tokenizer",
    "read_examples",
    "encode",
    "to_rows",
    "mask_path",
    "write_rows",
    "read_rows",
]

IGNORE = -100
"""The target of a position that is not trained: torch's cross_entropy ignore_index default."""


@dataclass(frozen=True)
class Example:
    """One tokenized example: its ids and, per id, whether it is trained (as the target of the id before it)."""

    ids: list[int]
    trained: list[bool]


class ChatTokenizer:
    """A tokenizer folder read by transformers (its chat template with it), for instruction data; the folder is
    checked first by mobiuspipe.data.tokenizer.load_tokenizer (tokenizer.json, its end-of-text token)."""

    def __init__(self, folder: str, key: str):
        from transformers import AutoTokenizer

        self.folder, self.key = folder, key
        self.tok = AutoTokenizer.from_pretrained(folder)
        named = self.tok.eos_token_id  # else the end-of-text token text data takes (load_tokenizer's EOS_CANDIDATES)
        self.eos_id: int | None = named if named is not None else load_tokenizer(folder, key).eos_id

    @property
    def pad_id(self) -> int:
        """What pads a sequence after its example: the end-of-text token, else the pad token, else 0."""
        for candidate in (self.eos_id, self.tok.pad_token_id):
            if candidate is not None:
                return int(candidate)
        return 0

    def render(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        """The ids of `messages` rendered with the chat template."""
        if not self.tok.chat_template:
            raise data_error(
                self.key,
                "a tokenizer folder with a chat template (tokenizer_config.json chat_template, or chat_template.jinja)",
                f"{self.folder} without one, for the messages of {where}",
                "use the chat model's own tokenizer folder, or give prompt/response examples",
            )
        try:
            ids = self.tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        except Exception as e:
            raise data_error(self.key, "messages the chat template renders", f"{where}: {e}", _MESSAGES_FIX) from e
        return [int(i) for i in ids]

    def prompt_response(self, prompt: str, response: str) -> Example:
        """The ids of a prompt and its response (see the module docstring)."""
        head = self.tok(prompt)["input_ids"]
        tail = self.tok(response, add_special_tokens=False)["input_ids"]
        if self.eos_id is not None:
            tail = [*tail, self.eos_id]
        return Example([*head, *tail], [False] * len(head) + [True] * len(tail))


_MESSAGES_FIX = 'write each line as {"messages": [{"role": "user", "content": "..."}, ...]}'


def load_chat_tokenizer(folder: str, key: str = "data.tokenizer") -> ChatTokenizer:
    return ChatTokenizer(folder, key)


def _conversation(tok: ChatTokenizer, messages: Any, where: str) -> Example:
    """A conversation's ids, each assistant message's trained (the tokens it adds to the rendering before it)."""
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise data_error(tok.key, "a non-empty list of {role, content} messages", where, _MESSAGES_FIX)
    ids: list[int] = []
    trained: list[bool] = []
    for k in range(len(messages)):
        now = tok.render(messages[: k + 1], where)
        if now[: len(ids)] != ids:
            raise data_error(
                tok.key,
                "a chat template whose rendering of the first messages starts the rendering of more",
                f"{where}: message {k} changes the tokens before it",
                "give prompt/response examples instead, or a template that renders each message in turn",
            )
        trained += [messages[k]["role"] == "assistant"] * (len(now) - len(ids))
        ids = now
    return Example(ids, trained)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def encode(tok: ChatTokenizer, record: Any, where: str) -> Example:
    """One JSONL record as an Example: `messages`, or `prompt` and `response`."""
    if isinstance(record, dict) and "messages" in record:
        return _conversation(tok, record["messages"], where)
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return tok.prompt_response(record["prompt"], record["response"])
    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
    raise data_error(
        tok.key,
        "instruction examples: a `messages` list, or `prompt` and `response` strings, in every line",
        f"{where}: {keys}",
        'write each line as {"messages": [...]} or {"prompt": "...", "response": "..."}',
    )


def read_examples(path: str, key: str, split: str = "train") -> Iterator[tuple[Any, str]]:
    """Each non-blank line of a JSONL file as (record, "line N of PATH"), or each row of a datasets folder (its
    `split`)."""
    if is_dataset_folder(path):
        yield from dataset_records(path, split, key)
        return
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"line {n} of {path}"
                try:
                    yield json.loads(line), where
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise data_error(key, "one JSON object per line", f"{where}: {e}", f"fix {where}") from e
    except OSError as e:
        raise unreadable(key, path, e) from e


def to_rows(examples: list[Example], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids of shape (N, seq_len + 1), targets of shape (N, seq_len) with IGNORE where not trained, examples
    dropped for having no trained target left after the cut) by the module docstring's rules."""
    t = seq_len
    ids, targets, dropped = [], [], 0
    for ex in examples:
        row, trained = ex.ids[: t + 1], ex.trained[: t + 1]
        if not any(trained[1:]):
            dropped += 1
            continue
        pad = t + 1 - len(row)
        row_ids = np.asarray(row + [pad_id] * pad, np.int64)
        target = np.where(np.asarray(trained[1:] + [False] * pad), row_ids[1:], IGNORE)
        ids.append(row_ids)
        targets.append(target)
    if not ids:
        return np.zeros((0, t + 1), np.int64), np.zeros((0, t), np.int64), dropped
    return np.stack(ids), np.stack(targets).astype(np.int64), dropped


def mask_path(path: str) -> str:
    """The mask file beside an examples file: FILE.bin -> FILE.mask.bin."""
    return path[: -len(".bin")] + ".mask.bin" if path.lower().endswith(".bin") else path + ".mask.bin"


def write_rows(rows: np.ndarray, targets: np.ndarray, path: str, token_dtype: str) -> None:
    """Write examples as FILE.bin and FILE.mask.bin (see the module docstring)."""
    write_token_file([rows.reshape(-1)], path, token_dtype)
    write_token_file([(targets != IGNORE).reshape(-1).astype(np.uint8)], mask_path(path), "uint8")


def read_rows(path: str, token_dtype: str, seq_len: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows (N, seq_len + 1) of ids, mask (N, seq_len), 1 where the target trains) of an examples file, both
    memory-mapped; ConfigError when its mask file is missing or the two were written for another seq_len."""
    ids = open_token_file(path, token_dtype, key)
    mask_file = mask_path(path)
    if not os.path.isfile(mask_file):
        raise data_error(
            key,
            f"instruction examples written by `mobiuspipe tokenize --format instruction`: {mask_file} beside {path}",
            f"no {mask_file}",
            "tokenize the examples again with --format instruction, or give their .jsonl as data.path",
        )
    mask = open_token_file(mask_file, "uint8", key)
    n = len(ids) - len(mask)
    if n <= 0 or len(mask) % n or len(mask) // n != seq_len:
        made = f"seq_len {len(mask) // n}" if n > 0 and len(mask) % n == 0 else "no whole rows"
        other = "uint32" if token_dtype == "uint16" else "uint16"
        wide = len(ids) * np.dtype(token_dtype).itemsize // np.dtype(other).itemsize  # the ids read as `other`
        fix = (
            f"set data.token_dtype: {other} (the file's ids are {np.dtype(other).itemsize} bytes each)"
            if wide > len(mask) and len(mask) % (wide - len(mask)) == 0 and len(mask) // (wide - len(mask)) == seq_len
            else f"tokenize again with --seq-len {seq_len}, or set model.seq_len to the one they were written for"
        )
        raise data_error(
            key,
            f"examples of model.seq_len {seq_len} + 1 ids ({path} and {mask_file} sizes agree on a row length)",
            f"{len(ids):,} ids ({token_dtype}) and {len(mask):,} mask bytes: {made}",
            fix,
        )
    return ids.reshape(n, seq_len + 1), mask.reshape(n, seq_len)
