"""Bad data is one clear ConfigError naming the file, the line or the numbers and the fix, raised by the config
loader or by open_data before any rank starts work (`mobiuspipe train` checks before launching torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from mobiuspipe.config import load_config
from mobiuspipe.config.data import DataConfig
from mobiuspipe.data.dataset import open_data, open_eval
from mobiuspipe.data.token_file import Vocabulary
from mobiuspipe.errors import ConfigError


def _open(tmp_path, data: dict, seq_len: int = 5, vocab_size: int | Vocabulary = 300):
    """open_data and open_eval of a config file in tmp_path with this data: section (paths relative to it)."""
    path = tmp_path / "run.yaml"
    size = vocab_size.size if isinstance(vocab_size, Vocabulary) else vocab_size
    path.write_text(yaml.safe_dump({"data": data, "model": {"seq_len": seq_len, "vocab_size": size}}))
    cfg = load_config(path)
    open_data(cfg.data, seq_len, 0, vocab_size)
    return open_eval(cfg.data, seq_len, vocab_size)


def test_paths_are_resolved_against_the_config_files_folder(tmp_path, tokenizer_dir):
    tokenizer_dir(tmp_path / "tok")
    (tmp_path / "d").mkdir()
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "d" / "t.bin")
    (tmp_path / "d" / "e.txt").write_text("the cat sat on the mat " * 9)
    (tmp_path / "run.yaml").write_text("data: {tokens: d/t.bin, tokenizer: tok, eval_path: d/e.txt}\n")
    data = load_config(tmp_path / "run.yaml").data
    assert (data.tokens, data.tokenizer, data.eval_path) == tuple(
        str(tmp_path / p) for p in ("d/t.bin", "tok", "d/e.txt")
    )
    assert data.shuffle and data.field == "text" and data.token_dtype == "uint16"


@pytest.mark.parametrize(
    "data,message",
    [
        ({"path": "a.txt", "tokens": "t.bin"}, r"data\.tokens: expected either data\.path .* or data\.tokens"),
        ({"path": "a.jsonl"}, r"data\.tokenizer: expected a tokenizer folder when path or eval_path is JSONL"),
        ({"path": "t.bin"}, r"data\.path: expected a text or JSONL file.*fix: give a token file as `tokens:`"),
        ({"tokens": "t.bin", "eval_path": "a.txt"}, r"data\.eval_path: expected a token file \(\.bin\) like"),
        ({"tokens": "t.bin", "token_dtype": "int8"}, r"data\.token_dtype: expected one of uint16, uint32"),
        ({"tokenizer": "a.txt"}, r"data\.tokenizer: expected an existing folder.*a file; fix: give the folder"),
        ({"tokenizer": "nope"}, r"data\.tokenizer: expected an existing folder.*which does not exist"),
        ({"field": ""}, r"data\.field: expected a non-empty string"),
    ],
)
def test_config_problems_name_the_key_and_the_fix(tmp_path, data, message):
    for name in ("a.txt", "a.jsonl", "t.bin"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    with pytest.raises(ConfigError, match=message):
        _open(tmp_path, data)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, tokenizer_dir):
    tokenizer_dir(tmp_path / "tok", vocab_size=300)
    (tmp_path / "a.txt").write_text("the cat")
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=r"data\.tokenizer: .* 300 token ids"):  # set, though the .bin needs none
        _open(tmp_path, {"tokens": "t.bin", "tokenizer": "tok"}, vocab_size=257)
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, {"path": "a.txt", "tokenizer": "tok"}, vocab_size=257)
    assert str(e.value) == (
        f"data.tokenizer: expected a vocabulary that fits the model's vocab_size 257, found {tmp_path}/tok/"
        "tokenizer.json with 300 token ids (added tokens included); fix: raise model.vocab_size to at least 300, or "
        "use data made with the model's own tokenizer"
    )


def test_a_hugging_face_models_vocabulary_is_not_raised_by_config(tmp_path, tokenizer_dir):
    """For model.hf the advice is the model's own tokenizer: model.vocab_size does not apply."""
    tokenizer_dir(tmp_path / "tok", vocab_size=300)
    (tmp_path / "a.txt").write_text("the cat")
    np.arange(400, dtype=np.uint16).tofile(tmp_path / "t.bin")
    hf = Vocabulary(257, from_model=True)
    for data in ({"path": "a.txt", "tokenizer": "tok"}, {"tokens": "t.bin"}):
        with pytest.raises(ConfigError) as e:
            _open(tmp_path, data, vocab_size=hf)
        assert "fix: use the model's own tokenizer (data.tokenizer: the model's folder) or data made with it" in str(
            e.value
        )
        assert "config.json's vocab_size (257), not model.vocab_size" in str(e.value)


def test_a_tokenizer_folder_needs_tokenizer_json_and_a_known_eos(tmp_path, tokenizer_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"a folder holding tokenizer\.json.*empty without tokenizer\.json; fix: "):
        _open(tmp_path, {"path": "a.txt", "tokenizer": "empty"})
    folder = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError, match=r"names '<\|im_end\|>', which .*tokenizer\.json does not know"):
        _open(tmp_path, {"path": "a.txt", "tokenizer": "tok"})


@pytest.mark.parametrize(
    "line,found",
    [
        ('{"text": "the cat", ', r"line 3 of .*bad\.jsonl: Expecting"),
        ('{"prompt": "a", "answer": "b"}', r"expected a 'text' key \(data\.field\) .*line 3 of .*: prompt, answer"),
        ('["the cat"]', r"line 3 of .*bad\.jsonl: list"),
        ('{"text": 17}', r"expected a string under 'text', found line 3 of .*bad\.jsonl: 'text' holds int"),
    ],
)
def test_a_bad_jsonl_line_names_the_file_and_line(tmp_path, tokenizer_dir, line, found):
    tokenizer_dir(tmp_path / "tok")
    (tmp_path / "bad.jsonl").write_text('{"text": "the cat"}\n\n' + line + '\n{"text": "a dog"}\n')
    with pytest.raises(
        ConfigError, match=r"data\.path: .*" + found + r".*fix: fix line 3 of .*bad\.jsonl, or set data"
    ):
        _open(tmp_path, {"path": "bad.jsonl", "tokenizer": "tok"})


def test_text_that_is_not_utf8_names_the_byte(tmp_path, tokenizer_dir):
    tokenizer_dir(tmp_path / "tok")
    (tmp_path / "a.txt").write_bytes("the cat é".encode() + b"\xff\xfe more")
    with pytest.raises(ConfigError, match=r"expected UTF-8 text, found .*a\.txt, not UTF-8 at byte 10; fix: convert"):
        _open(tmp_path, {"path": "a.txt", "tokenizer": "tok"})


def test_token_files_that_do_not_fit(tmp_path):
    np.arange(31, dtype=np.uint16).tofile(tmp_path / "t.bin")  # 62 bytes
    with pytest.raises(
        ConfigError,
        match=r"found .*t\.bin of 62 bytes, not a multiple of 4 \(2 left over\); fix: "
        r"check data\.token_dtype \(is it uint16\?\)",
    ):
        _open(tmp_path, {"tokens": "t.bin", "token_dtype": "uint32"})
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, {"tokens": "t.bin", "batch_size": 7, "num_microbatches": 7})
    assert str(e.value) == (
        "data.tokens: expected at least batch_size * seq_len + 1 = 7 * 5 + 1 = 36 tokens (one batch), found 31 "
        f"tokens from token file {tmp_path}/t.bin (uint16); fix: give more data, or lower data.batch_size or "
        "model.seq_len"
    )
    ids = np.random.default_rng(1).integers(0, 300, 77).astype(np.uint16)
    ids[50] = 4099
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(
        ConfigError,
        match=r"data\.tokens: expected token ids below the model's vocab_size 300, found "
        r"ids up to 4099 in token file .*t\.bin \(uint16\); fix: raise model\.vocab_size to at least 4100",
    ):
        _open(tmp_path, {"tokens": "t.bin"})


@pytest.mark.parametrize("key", ["tokens", "eval_path"])
def test_a_uint32_token_file_read_as_uint16_is_refused(tmp_path, key):
    """Small uint32 ids read as uint16 are the ids with a 0 after each: valid ids, silently wrong data."""
    ids = np.random.default_rng(3).integers(1, 300, 401, dtype=np.uint32)
    ids.astype("<u4").tofile(tmp_path / "wide.bin")
    ids.astype("<u2").tofile(tmp_path / "narrow.bin")
    data = {"tokens": "narrow.bin", key: "wide.bin"}
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, data)
    assert str(e.value).startswith(f"data.{key}: expected a token file of uint16 ids (data.token_dtype), found ")
    assert "wide.bin" in str(e.value) and "every second id is at most 3" in str(e.value)
    assert str(e.value).endswith("fix: set data.token_dtype: uint32 (the file's ids are 4 bytes each)")
    _open(tmp_path, {"tokens": "wide.bin", "eval_path": "wide.bin", "token_dtype": "uint32"})  # as written
    _open(tmp_path, {"tokens": "narrow.bin", "eval_path": "narrow.bin"})


@pytest.mark.parametrize("vocab", [128256, 262144])
def test_large_vocabulary_uint32_ids_read_as_uint16_are_refused(tmp_path, vocab):
    """A Llama 3 or Gemma vocabulary needs uint32 ids, whose upper halves are 0 to 3, not only 0 (Llama 3 starts each
    document with 128000, upper half 1): read as uint16 they were valid ids below 65,536, silently wrong data."""
    ids = np.random.default_rng(4).integers(0, vocab, 5000, dtype=np.uint32)
    ids[::100] = 128000  # <|begin_of_text|>
    ids.astype("<u4").tofile(tmp_path / "wide.bin")
    hf = Vocabulary(vocab, from_model=True)  # a Hugging Face model's: over the built-in GPT's model.vocab_size limit

    def opened(data: dict):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({"data": data, "model": {"seq_len": 5}}))
        return open_data(load_config(tmp_path / "run.yaml").data, 5, 0, hf)

    with pytest.raises(ConfigError, match=r"fix: set data.token_dtype: uint32 \(the file's ids are 4 bytes each\)"):
        opened({"tokens": "wide.bin"})
    opened({"tokens": "wide.bin", "token_dtype": "uint32"})


def test_a_uint16_token_file_read_as_uint32_names_the_dtype(tmp_path):
    """Two uint16 ids read as one uint32 are beyond any vocabulary of uint16 ids: the fix names data.token_dtype."""
    np.random.default_rng(5).integers(1, 300, 400, dtype=np.uint16).astype("<u2").tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=r"fix: set data.token_dtype: uint16 \(the file's ids look 2 bytes each\)"):
        _open(tmp_path, {"tokens": "t.bin", "token_dtype": "uint32"})


def test_bytes_above_a_small_vocabulary_are_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes([1, 2, 3, 200] * 20))
    with pytest.raises(ConfigError, match=r"vocab_size 100, found ids up to 200 in the bytes of .*a\.txt"):
        _open(tmp_path, {"path": "a.txt"}, vocab_size=100)


def test_a_held_out_set_must_hold_one_batch(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    (tmp_path / "held.txt").write_bytes(b"y" * 40)
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, {"path": "a.txt", "eval_path": "held.txt"})
    assert str(e.value).startswith(
        "data.eval_path: expected at least batch_size * seq_len + 1 = 8 * 5 + 1 = 41 tokens (one held-out batch), "
        f"found 40 tokens from the bytes of {tmp_path}/held.txt"
    )
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.eval_path: .* found 0 tokens from token file .*empty\.bin"):
        _open(tmp_path, {"path": "a.txt", "eval_path": "empty.bin"})
    assert _open(tmp_path, {"path": "a.txt", "eval_path": "a.txt"}) is not None


def test_an_unreadable_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.path: expected a readable file, found .*gone\.txt: No such file"):
        open_data(DataConfig(path=str(tmp_path / "gone.txt")), 5, 0, 256)


def _bad_run(tmp_path) -> str:
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "bad.yaml").write_text("data: {tokens: t.bin}\nplan: {num_gpus: 2}\n")
    return str(tmp_path / "bad.yaml")


def test_train_checks_the_data_before_launching_torchrun(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mobiuspipe", "train", "--config", _bad_run(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "launching" not in out.stderr
    assert out.stderr.startswith("mobiuspipe: error: data.tokens: expected at least batch_size * seq_len + 1 = 8 * 64")


def test_each_rank_checks_the_data_before_joining_the_group(tmp_path):
    """The torchrun entry alone (no torchrun, no process group): it stops at the data, before the Pipeline."""
    out = subprocess.run(
        [sys.executable, "-m", "mobiuspipe.train", "--config", _bad_run(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("mobiuspipe.train: error: data.tokens: expected at least")


def test_accumulation_needs_one_optimizer_steps_sequences(tmp_path):
    """A step of train.accumulation_steps passes reads accumulation_steps * batch_size sequences at once."""
    from mobiuspipe.data.dataset import open_run_data

    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    doc = {"data": {"tokens": "t.bin", "batch_size": 4, "num_microbatches": 2}, "model": {"seq_len": 12}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    assert open_run_data(load_config(tmp_path / "run.yaml"))[0].num_sequences == 8  # 2 steps of 4
    doc["train"] = {"accumulation_steps": 3}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        open_run_data(load_config(tmp_path / "run.yaml"))
    assert str(e.value).startswith(
        "data.tokens: expected at least batch_size * accumulation_steps * seq_len + 1 = 4 * 3 * 12 + 1 = 145 "
        "tokens (one optimizer step), found 100 tokens"
    )
    fix = "fix: give more data, or lower data.batch_size, train.accumulation_steps or model.seq_len"
    assert str(e.value).endswith(fix)


def test_train_checks_the_hf_model_and_its_vocabulary_before_launching(tmp_path, hf_kit, tokenizer_dir):
    """A seq_len over the model's positions, and a tokenizer larger than the model's vocabulary (its
    config.json's, not model.vocab_size), stop `mobiuspipe train` before torchrun starts."""
    hf_kit.save_model("gpt2", tmp_path / "m")  # 48 positions, VOCAB token ids
    tokenizer_dir(tmp_path / "tok", vocab_size=hf_kit.VOCAB + 20)
    (tmp_path / "a.txt").write_text("the cat sat on the mat " * 50)
    runs = {
        "long.yaml": {"model": {"hf": "m", "seq_len": 49}},
        "tok.yaml": {"model": {"hf": "m", "seq_len": 16}, "data": {"path": "a.txt", "tokenizer": "tok"}},
    }
    errors = {}
    for name, doc in runs.items():
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        out = subprocess.run(
            [sys.executable, "-m", "mobiuspipe", "train", "--config", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and out.stdout == "" and "launching" not in out.stderr, out.stderr
        errors[name] = out.stderr
    assert "model.seq_len 49 exceeds the model's 48 positions" in errors["long.yaml"]
    want = f"data.tokenizer: expected a vocabulary that fits the model's vocab_size {hf_kit.VOCAB}"
    assert want in errors["tok.yaml"]
