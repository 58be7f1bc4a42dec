"""The packing rule (sequence n = tokens[n*T : n*T + T + 1]), the order of steps with and without shuffling, held-out
batches, and token files and byte-level text read through open_data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mobiuspipe.config.data import DataConfig
from mobiuspipe.data.dataset import PackedTokens, open_data, open_eval


def _by_hand(tokens: list[int], T: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokens[n * T : n * T + T + 1] for n in seqs]
    return torch.tensor([r[:-1] for r in rows]), torch.tensor([r[1:] for r in rows])


def test_in_order_steps_take_consecutive_sequences_and_wrap_into_the_next_epoch():
    rng = np.random.default_rng(11)
    T, B, L = 5, 3, 23  # N = (23 - 1) // 5 = 4 sequences; the last token of the file is never an input
    tokens = rng.integers(0, 1000, L).tolist()
    data = PackedTokens(np.array(tokens, np.uint16), T)
    assert data.num_sequences == 4
    expected = [[0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3]]  # step s takes places 3s .. 3s + 2, place k = seq k % 4
    for step, seqs in enumerate(expected):
        x, y = data.batch(step, B)
        ex, ey = _by_hand(tokens, T, seqs)
        assert x.dtype == y.dtype == torch.int64 and x.shape == (B, T)
        assert torch.equal(x, ex) and torch.equal(y, ey), step
    assert torch.equal(data.batch(0, B)[1][0, -1], torch.tensor(tokens[T]))  # targets overlap the next sequence


def test_sequences_need_seq_len_plus_one_tokens():
    assert PackedTokens(np.arange(10), 3).num_sequences == 3  # tokens 0..9: [0,4) [3,7) [6,10)
    assert PackedTokens(np.arange(9), 3).num_sequences == 2
    assert PackedTokens(np.arange(1), 3).num_sequences == 0


def _places(data: PackedTokens, steps: int, B: int) -> list[int]:
    return [int(n) for s in range(steps) for n in data.indices(s, B)]


def test_shuffle_is_a_new_permutation_each_epoch_and_the_same_on_every_open():
    rng = np.random.default_rng(3)
    T, B, N = 7, 5, 37
    tokens = rng.integers(0, 50000, N * T + 1 + 4)  # 4 tokens left over: still N sequences
    data = PackedTokens(tokens, T, seed=9, shuffle=True)
    assert data.num_sequences == N
    places = _places(data, 3 * N, B)  # 3 * 37 * 5 places = 15 whole epochs, the batches crossing epoch borders
    epochs = [places[e * N : (e + 1) * N] for e in range(15)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 15 and epochs[0] != list(range(N))
    again = PackedTokens(tokens.copy(), T, seed=9, shuffle=True)  # another rank: same batches, in any order
    for step in (40, 0, 7, 36):
        assert all(torch.equal(a, b) for a, b in zip(again.batch(step, B), data.batch(step, B)))
        seqs = data.indices(step, B).tolist()
        assert all(torch.equal(a, b) for a, b in zip(data.batch(step, B), _by_hand(tokens.tolist(), T, seqs)))
    other = PackedTokens(tokens, T, seed=10, shuffle=True)
    assert _places(other, 8, B) != places[: 8 * B]


def test_eval_batches_are_full_batches_in_file_order():
    tokens = np.random.default_rng(5).integers(0, 300, 3 * 11 + 1)  # 11 sequences of 3 + 1
    data = PackedTokens(tokens, 3, seed=1, shuffle=True)  # shuffling never touches held-out batches
    batches = list(data.eval_batches(4))
    assert len(batches) == 2  # sequences 8, 9, 10 do not fill a batch: left out
    for k, (x, y) in enumerate(batches):
        ex, ey = _by_hand(tokens.tolist(), 3, list(range(4 * k, 4 * k + 4)))
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert len(list(data.eval_batches(4, max_batches=1))) == 1
    assert len(list(data.eval_batches(2, max_batches=9))) == 5


@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 2**32 - 1)])
def test_token_files_round_trip(tmp_path, dtype, top):
    rng = np.random.default_rng(17)
    T, B = 6, 3
    ids = rng.integers(0, top, 7 * T + 2, dtype=np.int64)
    ids[5] = top
    path = tmp_path / "train.bin"
    ids.astype(dtype).tofile(path)
    cfg = DataConfig(tokens=str(path), token_dtype=dtype, batch_size=B, num_microbatches=1, shuffle=False)
    data = open_data(cfg, T, seed=0, vocab_size=top + 1)
    assert isinstance(data.tokens, np.memmap) and data.num_sequences == 7
    assert np.array_equal(np.asarray(data.tokens), ids)
    for step in range(4):
        seqs = [(step * B + i) % 7 for i in range(B)]
        assert all(torch.equal(a, b) for a, b in zip(data.batch(step, B), _by_hand(ids.tolist(), T, seqs)))
    assert "token file" in data.describe() and dtype in data.describe()


def test_text_without_a_tokenizer_is_bytes_packed_alike(tmp_path):
    raw = bytes(np.random.default_rng(2).integers(0, 256, 61, dtype=np.uint8))
    (tmp_path / "t.txt").write_bytes(raw)
    (tmp_path / "held.txt").write_bytes(raw[::-1])
    cfg = DataConfig(
        path=str(tmp_path / "t.txt"),
        eval_path=str(tmp_path / "held.txt"),
        batch_size=2,
        num_microbatches=2,
        shuffle=False,
    )
    data = open_data(cfg, 9, seed=4, vocab_size=256)
    assert data.num_sequences == 6
    assert all(torch.equal(a, b) for a, b in zip(data.batch(1, 2), _by_hand(list(raw), 9, [2, 3])))
    held = open_eval(cfg, 9, vocab_size=256)
    assert held is not None and not held.shuffle
    assert all(torch.equal(a, b) for a, b in zip(next(held.eval_batches(2)), _by_hand(list(raw[::-1]), 9, [0, 1])))
    assert open_eval(DataConfig(), 9, 256) is None


def test_the_sample_text_is_the_default(tmp_path):
    data = open_data(DataConfig(), 64, seed=0, vocab_size=256)
    assert data.shuffle and data.num_sequences == (len(data.tokens) - 1) // 64 and "sample.txt" in data.describe()
