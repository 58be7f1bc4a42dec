"""Instruction data: prompt/response and chat messages tokenized with the loss on the response (assistant) tokens
alone, checked by hand and against transformers' apply_chat_template; masked targets carry no loss; one example per
sequence, cut and padded; the config's rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import InstructionRows, open_data
from mobiuspipe.data.instruct import IGNORE, Example, encode, load_chat_tokenizer, to_rows
from mobiuspipe.errors import ConfigError
from mobiuspipe.models.gpt import lm_loss


@pytest.fixture
def chat_dir(tmp_path, chat_tokenizer_dir):
    return chat_tokenizer_dir(tmp_path / "tok")


def test_prompt_and_response_by_hand(chat_dir):
    tok = load_chat_tokenizer(str(chat_dir))
    ex = encode(tok, {"prompt": "a quick brown", "response": " fox jumps"}, "line 1")
    head, tail = tok.tok("a quick brown")["input_ids"], tok.tok(" fox jumps", add_special_tokens=False)["input_ids"]
    eos = tok.tok.convert_tokens_to_ids("<|endoftext|>")
    assert ex.ids == [*head, *tail, eos] and ex.trained == [False] * len(head) + [True] * (len(tail) + 1)
    t = len(ex.ids) + 2  # two pads after the end-of-text token
    rows, targets, dropped = to_rows([ex], t, tok.pad_id)
    assert dropped == 0 and rows.shape == (1, t + 1) and targets.shape == (1, t)
    want = [IGNORE] * (len(head) - 1) + [*tail, eos] + [IGNORE] * 3  # target j is id j + 1 where that id trains
    assert targets[0].tolist() == want and rows[0].tolist() == [*ex.ids, eos, eos, eos]


def test_a_response_ends_with_the_end_of_text_token_a_text_run_would_take(tmp_path, tokenizer_dir):
    """A tokenizer folder whose tokenizer_config.json names no eos_token (here: none at all): text data ends each
    document with the first known end-of-text token the tokenizer has (<|endoftext|>); instruction data ended each
    response with nothing, so the model never learnt to stop."""
    tok = load_chat_tokenizer(str(tokenizer_dir(tmp_path / "tok")))
    ex = encode(tok, {"prompt": "a quick brown", "response": " fox jumps"}, "line 1")
    eos = tok.tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_id == eos and ex.ids[-1] == eos and ex.trained[-1]


def test_messages_render_as_apply_chat_template_and_train_the_assistants_tokens(chat_dir):
    tok = load_chat_tokenizer(str(chat_dir))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the lazy dog"},
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "stage by stage"},
    ]
    ex = encode(tok, {"messages": messages}, "line 1")
    assert ex.ids == tok.tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    trained = tok.tok.decode([i for i, t in zip(ex.ids, ex.trained) if t])
    assert trained == "<|assistant|>jumps over<|end|><|assistant|>stage by stage<|end|>"
    assert not any(ex.trained[: len(tok.tok.apply_chat_template(messages[:2], tokenize=True, return_dict=False))])


def test_masked_targets_carry_no_loss():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 11)
    targets = torch.tensor([[IGNORE, IGNORE, 4, 7, IGNORE], [IGNORE, 1, 2, IGNORE, IGNORE]])
    by_hand = (
        -sum(
            torch.log_softmax(logits[b, p], -1)[targets[b, p]] for b in range(2) for p in range(5) if targets[b, p] >= 0
        )
        / 4
    )
    assert float(lm_loss(logits, targets)) == pytest.approx(float(by_hand), rel=1e-6)
    moved = logits.clone()
    moved[0, 0] += 5.0  # a masked position's logits: no effect
    moved[1, 4] -= 3.0
    assert torch.equal(lm_loss(moved, targets), lm_loss(logits, targets))


def test_a_long_example_is_cut_and_one_with_no_response_left_is_dropped():
    long = Example(list(range(1, 11)), [False] * 3 + [True] * 7)
    prompt_only = Example(list(range(1, 11)), [False] * 8 + [True] * 2)
    rows, targets, dropped = to_rows([long, prompt_only], 5, 0)
    assert dropped == 1 and rows.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert targets.tolist() == [[IGNORE, IGNORE, 4, 5, 6]]


def _config(tmp_path, chat_dir, **data):
    return config_from_dict(
        {
            "model": {"vocab_size": 300, "seq_len": 24},
            "data": {
                "format": "instruction",
                "tokenizer": str(chat_dir),
                "batch_size": 2,
                "num_microbatches": 2,
                **data,
            },
        }  # fmt: skip
    )


def test_a_run_reads_examples_one_per_sequence(tmp_path, chat_dir):
    lines = [
        {"prompt": "a quick brown", "response": " fox"},
        {"messages": [{"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": "jumps"}]},
        {"prompt": "numbers", "response": " 12345 too"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = _config(tmp_path, chat_dir, path=str(path), shuffle=False)
    data = open_data(cfg.data, cfg.model.seq_len, 0, 300)
    assert isinstance(data, InstructionRows) and data.num_sequences == 3
    x, y = data.batch(0, 2)
    assert x.shape == y.shape == (2, 24) and x.dtype == y.dtype == torch.int64
    rows = torch.from_numpy(data.rows[:2])
    trained = y != IGNORE  # a trained target is the next id; every example trains some
    assert torch.equal(x, rows[:, :-1]) and trained.any(dim=1).all() and torch.equal(y[trained], rows[:, 1:][trained])
    assert "3 instruction examples" in data.describe() and "targets trained" in data.describe()
    assert np.array_equal(data.batch(1, 2)[0][0].numpy(), data.rows[2, :-1])  # wraps into the next epoch


@pytest.mark.parametrize(
    "data,key,words",
    [
        ({"path": "train.txt"}, "data.path", "a .jsonl file or datasets folder of instruction examples"),
        ({"path": "train.jsonl", "eval_path": "train.txt"}, "data.eval_path", "held-out instruction examples"),
        ({"path": "train.jsonl", "format": "chat"}, "data.format", "one of text, instruction"),
    ],
)
def test_the_config_refuses_what_instruction_data_cannot_be(tmp_path, chat_dir, data, key, words):
    for name in ("train.txt", "t.bin", "train.jsonl"):
        (tmp_path / name).write_text("x")
    data = {k: str(tmp_path / v) if k in ("path", "tokens", "eval_path") else v for k, v in data.items()}
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, chat_dir, **data)
    assert key in str(e.value) and words in str(e.value)


def test_a_line_that_is_no_example_and_a_template_less_tokenizer_are_named(tmp_path, chat_dir, tokenizer_dir):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    cfg = _config(tmp_path, chat_dir, path=str(path))
    with pytest.raises(ConfigError, match=r"a `messages` list, or `prompt` and `response` strings.*line 1 of"):
        open_data(cfg.data, 24, 0, 300)
    plain = tokenizer_dir(tmp_path / "plain", eos="<|endoftext|>")
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = _config(tmp_path, plain, path=str(path))
    with pytest.raises(ConfigError, match="a tokenizer folder with a chat template"):
        open_data(cfg.data, 24, 0, 300)


def test_tokenized_once_the_examples_train_the_same(tmp_path, chat_dir):
    """`mobiuspipe tokenize --format instruction` writes the rows and mask that the .jsonl gives at start-up."""
    from mobiuspipe.cli import main as cli_main

    lines: list[dict] = [
        {"prompt": "a quick brown", "response": " fox"},
        {"prompt": "the lazy", "response": " dog " * 9},
    ]
    lines.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "stream"}]})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "train.bin"
    argv = ["tokenize", "--tokenizer", str(chat_dir), "--input", str(path), "-o", str(out), "--format", "instruction"]
    assert cli_main(argv + ["--seq-len", "12"]) == 0
    assert (tmp_path / "train.mask.bin").is_file()
    cfg = _config(tmp_path, chat_dir, path=str(path), shuffle=False)
    from_jsonl = open_data(cfg.data, 12, 0, 300)
    cfg = _config(tmp_path, chat_dir, tokens=str(out), shuffle=False)
    from_file = open_data(cfg.data, 12, 0, 300)
    assert isinstance(from_file, InstructionRows) and isinstance(from_jsonl, InstructionRows)
    assert np.array_equal(from_file.rows, from_jsonl.rows) and np.array_equal(from_file.trained, from_jsonl.trained)
    with pytest.raises(ConfigError, match=r"tokenize again with --seq-len 16"):
        open_data(cfg.data, 16, 0, 300)
    even = tmp_path / "even.bin"  # 3 rows of 14 ids: a size uint32 ids could have
    assert cli_main([*argv[:-4], "-o", str(even), "--format", "instruction", "--seq-len", "13"]) == 0
    wide = _config(tmp_path, chat_dir, tokens=str(even), shuffle=False, token_dtype="uint32")
    with pytest.raises(
        ConfigError, match=r"\(uint32\) and .*; fix: set data.token_dtype: uint16 \(the file's ids are 2"
    ):
        open_data(wide.data, 13, 0, 300)  # a uint16 examples file read as uint32: its dtype, not its seq_len


def test_a_datasets_folder_is_read_as_its_jsonl_would_be(tmp_path, chat_dir):
    """save_to_disk's folder (a DatasetDict: its split), and a folder of parquet files, give the rows the same
    examples in a .jsonl give; a split that is not there is named with those that are."""
    import datasets

    lines = [
        {"prompt": "a quick brown", "response": " fox"},
        {"prompt": "the lazy", "response": " dog"},
        {"prompt": "numbers", "response": " 12345"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = datasets.Dataset.from_list(lines)
    datasets.DatasetDict({"train": rows, "test": rows.select([0])}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    rows.to_parquet(str(tmp_path / "pq" / "train.parquet"))
    want = open_data(_config(tmp_path, chat_dir, path=str(tmp_path / "train.jsonl"), shuffle=False).data, 12, 0, 300)
    for folder in ("saved", "pq"):
        got = open_data(_config(tmp_path, chat_dir, path=str(tmp_path / folder), shuffle=False).data, 12, 0, 300)
        assert isinstance(got, InstructionRows) and isinstance(want, InstructionRows)
        assert np.array_equal(got.rows, want.rows) and np.array_equal(got.trained, want.trained)
    cfg = _config(tmp_path, chat_dir, path=str(tmp_path / "saved"), split="validation")
    with pytest.raises(ConfigError, match=r"a split 'validation' in the datasets folder.*splits train, test"):
        open_data(cfg.data, 12, 0, 300)


def test_a_datasets_folder_of_documents_is_tokenized_as_text(tmp_path, tokenizer_dir):
    import datasets

    from mobiuspipe.data.tokenizer import load_tokenizer

    tok_dir = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    docs = ["a quick brown fox jumps over the lazy dog"] * 3 + ["pipelines stream weights from the host"] * 3
    datasets.Dataset.from_list([{"text": d} for d in docs]).save_to_disk(str(tmp_path / "docs"))
    cfg = config_from_dict(
        {"model": {"vocab_size": 300, "seq_len": 8}, "data": {"path": str(tmp_path / "docs"), "tokenizer": str(tok_dir),
                                                             "batch_size": 2, "num_microbatches": 1}}
    )  # fmt: skip
    data = open_data(cfg.data, 8, 0, 300)
    assert np.array_equal(np.asarray(data.tokens), load_tokenizer(str(tok_dir)).encode(docs))
