"""Training and held-out data: a stream of token ids packed into sequences of seq_len + 1 tokens, batched from
(seed, step) alike on every rank, so no rank ships data to another.

The packing rule (T = seq_len, B = batch size): sequence n is tokens[n*T : n*T + T + 1], its first T tokens the
inputs and its last T the targets; there are N = (len(tokens) - 1) // T of them (the last token of one is
the first of the next). Step s takes the B sequences at places s*B .. s*B + B - 1 of the order, place k being
sequence order_e[k % N] of epoch e = k // N, so a batch wraps into the next epoch. The order of an epoch is
0 .. N-1 (shuffle false), or a permutation of them drawn from numpy's generator seeded by (seed, epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from mobiuspipe.config.data import DataConfig, is_token_file
from mobiuspipe.data.instruct import IGNORE, encode, load_chat_tokenizer, read_examples, read_rows, to_rows
from mobiuspipe.data.token_file import Vocabulary, check_ids, data_error, open_bytes, open_token_file
from mobiuspipe.data.tokenizer import TextTokenizer, load_tokenizer, tokenize_file

if TYPE_CHECKING:
    from mobiuspipe.config import RunConfig

__all__ = ["PackedTokens", "InstructionRows", "open_data", "open_eval", "open_run_data"]


class PackedTokens:
    """Token ids (any integer array: a memory map stays one) packed into sequences of seq_len + 1 tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, shuffle: bool = False, source: str = ""):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.source = source
        """What the tokens are, for messages: e.g. "token file /d/train.bin (uint16)"."""
        self.num_sequences = max(0, (len(tokens) - 1) // seq_len)
        """N: sequences of seq_len + 1 tokens."""
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The sequences of `epoch` in the order steps take them: a permutation (shuffle) or 0 .. N-1."""
        if not self.shuffle:
            return np.arange(self.num_sequences)
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs when B <= N
                self._orders.pop(min(self._orders))
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._orders[epoch] = rng.permutation(self.num_sequences)
        return self._orders[epoch]

    def indices(self, step: int, batch_size: int) -> np.ndarray:
        """The sequence numbers of step `step`'s batch: places step*B .. step*B + B - 1, wrapping into new epochs."""
        places = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs, positions = np.divmod(places, self.num_sequences)
        if not self.shuffle:
            return positions
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            mine = epochs == e
            out[mine] = self.order(int(e))[positions[mine]]
        return out

    def sequences(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 of shape (len(indices), seq_len): the inputs and targets of those sequences."""
        starts = np.asarray(indices, np.int64)[:, None] * self.seq_len
        rows = torch.from_numpy(self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of optimizer step `step`: int64 (batch_size, seq_len); y is x shifted by one token."""
        return self.sequences(self.indices(step, batch_size))

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The full batches of sequences 0 .. N-1 in order, never shuffled (at most max_batches of them); the
        sequences after the last full batch are left out."""
        count = self.num_sequences // batch_size
        for k in range(count if max_batches is None else min(count, max_batches)):
            yield self.sequences(np.arange(k * batch_size, (k + 1) * batch_size))

    def describe(self) -> str:
        """One line: the tokens, the sequences and the order, e.g. for the start-up banner."""
        order = f"shuffled each epoch (seed {self.seed})" if self.shuffle else "in file order"
        return (
            f"{len(self.tokens):,} tokens from {self.source}, {self.num_sequences:,} sequences of "
            f"{self.seq_len} + 1 tokens, {order}"
        )


class InstructionRows(PackedTokens):
    """Instruction examples, one per sequence (mobiuspipe.data.instruct): rows of seq_len + 1 ids and, per target,
    whether it trains (`trained`: an examples file's mask, mapped, never read whole); a batch's targets are IGNORE
    where not trained. Batched and shuffled as packed sequences are."""

    def __init__(self, rows: np.ndarray, trained: np.ndarray, dropped: int, *, seed=0, shuffle=False, source=""):
        super().__init__(rows.reshape(-1), rows.shape[1] - 1, seed=seed, shuffle=shuffle, source=source)
        self.rows, self.trained, self.dropped = rows, trained, dropped
        self.num_sequences = len(rows)

    def sequences(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, np.int64)
        rows = self.rows[idx].astype(np.int64)
        targets = np.where(self.trained[idx] != 0, rows[:, 1:], IGNORE)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(targets)

    def describe(self) -> str:
        order = f"shuffled each epoch (seed {self.seed})" if self.shuffle else "in file order"
        trained = int(np.count_nonzero(self.trained))
        dropped = f", {self.dropped:,} dropped (no response token within seq_len + 1)" if self.dropped else ""
        return (
            f"{self.num_sequences:,} instruction examples from {self.source}, one per sequence of {self.seq_len} + 1 "
            f"tokens, {trained:,} of {self.trained.size:,} targets trained{dropped}, {order}"
        )


def _examples(data: DataConfig, path: str, key: str, vocab: Vocabulary, seq_len: int, **order) -> InstructionRows:
    """The instruction examples of a JSONL file, a datasets folder or an examples file, checked against the
    model's vocabulary."""
    if data.tokenizer is not None:
        _tokenizer(data, vocab)  # its vocabulary fits the model's
    if is_token_file(path):
        rows, trained = read_rows(path, data.token_dtype, seq_len, key)
        dropped, what = 0, f"examples file {path} ({data.token_dtype})"
    else:
        assert data.tokenizer is not None  # DataConfig: JSONL and datasets folders need one
        tok = load_chat_tokenizer(data.tokenizer)
        split = data.eval_split if key == "data.eval_path" else data.split
        examples = [encode(tok, record, where) for record, where in read_examples(path, key, split)]
        rows, targets, dropped = to_rows(examples, seq_len, tok.pad_id)
        trained = targets != IGNORE
        what = f"{path} through tokenizer {data.tokenizer}"
    check_ids(rows.reshape(-1), vocab, key, what)
    return InstructionRows(rows, trained, dropped, source=what, **order)


def _tokenizer(data: DataConfig, vocab: Vocabulary) -> TextTokenizer | None:
    """The config's tokenizer, checked against the model's vocabulary; None without one."""
    if data.tokenizer is None:
        return None
    tok = load_tokenizer(data.tokenizer)
    if tok.vocab_size > vocab.size:
        raise data_error(
            "data.tokenizer",
            f"a vocabulary that fits the model's vocab_size {vocab.size}",
            f"{data.tokenizer}/tokenizer.json with {tok.vocab_size:,} token ids (added tokens included)",
            vocab.fix(tok.vocab_size),
        )
    return tok


def _read(data: DataConfig, path: str, key: str, vocab: Vocabulary, token_file: bool) -> tuple[np.ndarray, str]:
    """The token ids of one source and what they are: a token file, text or JSONL tokenized, or text as bytes.
    A tokenizer that is set is checked even when this source does not need it."""
    tok = _tokenizer(data, vocab)
    if token_file:
        tokens, what = open_token_file(path, data.token_dtype, key), f"token file {path} ({data.token_dtype})"
    elif tok is not None:
        split = data.eval_split if key == "data.eval_path" else data.split
        tokens, what = tokenize_file(tok, path, data.field, key, split), f"{path} through {tok.describe()}"
        return tokens, what  # the tokenizer's vocabulary was checked: no id exceeds it
    else:
        tokens, what = open_bytes(path, key), f"the bytes of {path}"
    check_ids(tokens, vocab, key, what, data.token_dtype if token_file else None)
    return tokens, what


def _need_rows(examples: InstructionRows, key: str, rows: int, purpose: str) -> None:
    """At least `rows` examples (one sequence each)."""
    if examples.num_sequences < rows:
        dropped = (
            f" ({examples.dropped:,} more dropped: no response token within seq_len + 1)" if examples.dropped else ""
        )
        raise data_error(
            key,
            f"at least {rows:,} instruction examples ({purpose}: one sequence each)",
            f"{examples.num_sequences:,} from {examples.source}{dropped}",
            "give more examples, or lower data.batch_size (or train.accumulation_steps)",
        )


def _need_one_batch(tokens: np.ndarray, what: str, key: str, rows: dict[str, int], seq_len: int, purpose: str) -> None:
    """At least the product of `rows` (named factors: sequences of one batch) * seq_len + 1 tokens."""
    count = int(np.prod(list(rows.values())))
    need = count * seq_len + 1
    if len(tokens) < need:
        names, values = " * ".join(rows), " * ".join(str(v) for v in rows.values())
        raise data_error(
            key,
            f"at least {names} * seq_len + 1 = {values} * {seq_len} + 1 = {need:,} tokens ({purpose})",
            f"{len(tokens):,} tokens from {what}",
            "give more data, or lower "
            + ", ".join(f"{'data' if n == 'batch_size' else 'train'}.{n}" for n in rows)
            + " or model.seq_len",
        )


def open_data(
    data: DataConfig, seq_len: int, seed: int, vocab_size: int | Vocabulary, accumulation_steps: int = 1
) -> PackedTokens:
    """The training data of `data` (a token file, text or JSONL), packed for `seq_len` and shuffled from `seed`
    when data.shuffle; ConfigError when a file is unreadable or malformed, its ids exceed the model's
    vocabulary `vocab_size` (its size, or a Vocabulary; or its tokenizer's vocabulary does), or it holds less than one
    optimizer step (`accumulation_steps` batches)."""
    key = "data.tokens" if data.tokens else "data.path"
    if data.format == "instruction":
        source = data.tokens or data.text_path
        examples = _examples(data, source, key, _vocabulary(vocab_size), seq_len, seed=seed, shuffle=data.shuffle)
        _need_rows(examples, key, data.batch_size * accumulation_steps, "one optimizer step")
        return examples
    tokens, what = _read(data, data.tokens or data.text_path, key, _vocabulary(vocab_size), data.tokens is not None)
    rows, purpose = {"batch_size": data.batch_size}, "one batch"
    if accumulation_steps > 1:
        rows, purpose = rows | {"accumulation_steps": accumulation_steps}, "one optimizer step"
    _need_one_batch(tokens, what, key, rows, seq_len, purpose)
    return PackedTokens(tokens, seq_len, seed=seed, shuffle=data.shuffle, source=what)


def open_eval(data: DataConfig, seq_len: int, vocab_size: int | Vocabulary) -> PackedTokens | None:
    """The held-out data of data.eval_path, packed like the training data and never shuffled; None without one.
    ConfigError as open_data, and when it holds less than one batch."""
    if data.eval_path is None:
        return None
    path = data.eval_path
    if data.format == "instruction":
        examples = _examples(data, path, "data.eval_path", _vocabulary(vocab_size), seq_len)
        _need_rows(examples, "data.eval_path", data.batch_size, "one held-out batch")
        return examples
    tokens, what = _read(data, path, "data.eval_path", _vocabulary(vocab_size), is_token_file(path))
    _need_one_batch(tokens, what, "data.eval_path", {"batch_size": data.batch_size}, seq_len, "one held-out batch")
    return PackedTokens(tokens, seq_len, source=what)


def _vocabulary(vocab: int | Vocabulary) -> Vocabulary:
    return vocab if isinstance(vocab, Vocabulary) else Vocabulary(vocab)


def open_run_data(cfg: RunConfig) -> tuple[PackedTokens, PackedTokens | None]:
    """A run's training data (checked to hold one optimizer step: accumulation_steps * batch_size sequences)
    and its held-out data, against the model's vocabulary (a Hugging Face model's config.json vocab_size)."""
    vocab, seq_len = Vocabulary(cfg.model.model_vocab_size, from_model=cfg.model.hf is not None), cfg.model.seq_len
    steps = cfg.train.accumulation_steps
    return open_data(cfg.data, seq_len, cfg.train.seed, vocab, steps), open_eval(cfg.data, seq_len, vocab)
