"""Text and JSONL through a local tokenizer folder equal calling the tokenizer directly, documents ended by the
end-of-text token; `mobiuspipe tokenize` writes the same ids as a token file; a pipelined run on tokenized data
equals plain PyTorch."""

from __future__ import annotations

import json
import random
from functools import partial

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from mobiuspipe import Pipeline
from mobiuspipe.cli import main
from mobiuspipe.config import config_from_dict
from mobiuspipe.config.data import DataConfig
from mobiuspipe.data.dataset import open_data, open_eval
from mobiuspipe.data.tokenizer import load_tokenizer
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.host_threads import rank_threads
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

WORDS = "the cat sat on mat quick brown fox pipelines stream weights Ünïcode 12345 dog lazy , .".split()


def _docs(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(0, 23))) for _ in range(count)]


def _direct(folder, docs: list[str], eos: str | None) -> list[int]:
    """What the tokenizer gives for each document, each followed by `eos`."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tail = [] if eos is None else [tok.token_to_id(eos) or 0]
    return [i for d in docs for i in tok.encode(d).ids + tail]


def _jsonl(path, docs: list[str], field: str = "text") -> None:
    rows = [json.dumps({"id": k, field: d, "meta": {"n": k}}) for k, d in enumerate(docs)]
    rows.insert(3, "")  # a blank line is skipped
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_jsonl_documents_are_tokenized_and_ended_by_the_configs_eos(tmp_path, tokenizer_dir):
    folder = tokenizer_dir(tmp_path / "tok", specials=("<|endoftext|>", "<|eot|>"), eos="<|eot|>")
    docs = _docs(1, 1100)  # more than one encode_batch chunk
    _jsonl(tmp_path / "train.jsonl", docs, field="content")
    path = str(tmp_path / "train.jsonl")
    cfg = DataConfig(path=path, tokenizer=str(folder), field="content", batch_size=3, num_microbatches=1, shuffle=False)
    data = open_data(cfg, 7, seed=0, vocab_size=300)
    expected = _direct(folder, docs, "<|eot|>")
    assert data.tokens.tolist() == expected
    x, y = data.batch(2, 3)
    assert x[0].tolist() == expected[6 * 7 : 7 * 7] and y[0].tolist() == expected[6 * 7 + 1 : 7 * 7 + 1]
    assert "eos <|eot|> = 1" in data.describe() and "train.jsonl" in data.describe()


def test_a_text_file_is_one_document_and_without_a_config_a_known_eos_is_used(tmp_path, tokenizer_dir):
    folder = tokenizer_dir(tmp_path / "tok")  # tokenizer.json alone: <|endoftext|> is found in it
    text = "\n\n".join(_docs(2, 40)) + "\n"
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    cfg = DataConfig(path=str(tmp_path / "book.txt"), tokenizer=str(folder), batch_size=2, num_microbatches=2)
    data = open_data(cfg, 5, seed=3, vocab_size=1000)
    assert data.tokens.tolist() == _direct(folder, [text], "<|endoftext|>")
    assert load_tokenizer(str(folder)).eos_token == "<|endoftext|>"


def test_a_saved_truncation_or_padding_does_not_cut_documents(tmp_path, tokenizer_dir):
    folder = tokenizer_dir(tmp_path / "tok")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(max_length=3)
    tok.enable_padding(length=40)
    tok.save(str(folder / "tokenizer.json"))
    docs = _docs(9, 50)
    _jsonl(tmp_path / "d.jsonl", docs)
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), tokenizer=str(folder), batch_size=1, num_microbatches=1)
    tok.no_truncation()
    tok.no_padding()
    eos = tok.token_to_id("<|endoftext|>")
    assert open_data(cfg, 4, seed=0, vocab_size=300).tokens.tolist() == [
        i for d in docs for i in [*tok.encode(d).ids, eos]
    ]


def test_without_an_end_of_text_token_documents_follow_each_other(tmp_path, tokenizer_dir):
    folder = tokenizer_dir(tmp_path / "tok", specials=("<pad>",))
    docs = _docs(3, 30)
    _jsonl(tmp_path / "d.jsonl", docs)
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), tokenizer=str(folder), batch_size=1, num_microbatches=1)
    assert open_data(cfg, 4, seed=0, vocab_size=300).tokens.tolist() == _direct(folder, docs, None)


def test_held_out_jsonl_goes_through_the_same_tokenizer(tmp_path, tokenizer_dir):
    folder = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    train, held = _docs(4, 200), _docs(5, 60)
    _jsonl(tmp_path / "train.jsonl", train)
    _jsonl(tmp_path / "held.jsonl", held)
    cfg = DataConfig(
        path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "held.jsonl"), tokenizer=str(folder), batch_size=4
    )
    data = open_eval(cfg, 6, vocab_size=300)
    assert data is not None and data.tokens.tolist() == _direct(folder, held, "<|endoftext|>")
    first = next(data.eval_batches(4))[0]
    assert first[1].tolist() == data.tokens[6:12].tolist()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokenize_command_writes_what_training_reads(tmp_path, tokenizer_dir, dtype, capsys):
    folder = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    docs_a, docs_b = _docs(6, 700), _docs(7, 33)
    _jsonl(tmp_path / "a.jsonl", docs_a)
    _jsonl(tmp_path / "b.jsonl", docs_b)
    out = tmp_path / "train.bin"
    argv = ["tokenize", "--tokenizer", str(folder), "--input", str(tmp_path / "a.jsonl"), "--input"]
    assert main([*argv, str(tmp_path / "b.jsonl"), "-o", str(out), "--dtype", dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = _direct(folder, docs_a + docs_b, "<|endoftext|>")
    assert np.fromfile(out, dtype=dtype).tolist() == expected
    assert report["tokens"] == len(expected) and [i["tokens"] for i in report["inputs"]][1] == len(
        _direct(folder, docs_b, "<|endoftext|>")
    )
    common = {"tokenizer": str(folder), "batch_size": 3, "num_microbatches": 3, "token_dtype": dtype}
    from_bin = open_data(DataConfig(tokens=str(out), **common), 11, seed=7, vocab_size=300)
    from_jsonl = open_data(DataConfig(path=str(tmp_path / "a.jsonl"), **common), 11, seed=7, vocab_size=300)
    n = len(from_jsonl.tokens)
    assert np.array_equal(np.asarray(from_bin.tokens[:n]), from_jsonl.tokens)


def test_tokenize_command_refuses_ids_the_dtype_cannot_hold(tmp_path, capsys):
    from tokenizers import models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70001)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w70000 w5")
    out = tmp_path / "o.bin"
    args = ["tokenize", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "a.txt"), "-o", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "uint16 (ids below 65,536) for 70,001 ids" in err and "use --dtype uint32" in err
    assert not out.exists()
    assert main([*args, "--dtype", "uint32"]) == 0
    assert np.fromfile(out, dtype=np.uint32).tolist() == [1, 70000, 5]
    assert "wrote 3 tokens (uint32) from 1 file(s)" in capsys.readouterr().out


def test_tokenize_command_errors_are_one_line_and_leave_no_file(tmp_path, tokenizer_dir, capsys):
    folder = tokenizer_dir(tmp_path / "tok")
    _jsonl(tmp_path / "a.jsonl", _docs(10, 800))
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    out = tmp_path / "o.bin"
    base = ["tokenize", "--tokenizer", str(folder), "--input", str(tmp_path / "a.jsonl"), "-o"]
    assert main([*base, str(out), "--input", str(tmp_path / "b.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--input: expected a 'text' key" in err and "line 2 of" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "tok"]  # no o.bin, no o.bin.tmp
    assert main([*base, str(out), "--input", str(tmp_path / "none.jsonl")]) == 2
    assert "--input: expected a readable file, found " in capsys.readouterr().err
    assert main([*base, str(tmp_path / "no" / "o.bin")]) == 2
    assert "cannot write the token file to" in capsys.readouterr().err


def test_a_pipelined_run_on_tokenized_jsonl_equals_plain_pytorch(tmp_path, tokenizer_dir, reference):
    tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    _jsonl(tmp_path / "train.jsonl", _docs(8, 120))
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 2, "d_model": 12, "num_heads": 3, "seq_len": 13, "vocab_size": 301},
            "data": {"path": "train.jsonl", "tokenizer": "tok", "batch_size": 6, "num_microbatches": 3},
            "train": {"steps": 3, "lr": 0.01, "seed": 2, "precision": "fp32"},
            "plan": {"num_gpus": 1, "num_stages": 3, "device_memory_mb": 64},
        },
        base_dir=str(tmp_path),
    )
    t = cfg.train
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    optimizer = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(rank_threads(cfg.runtime.threads))  # as train() does, and as the reference does
    try:
        with Pipeline(
            layer_factories(model_spec(cfg), t.seed), lm_loss, plan=plan_for_config(cfg), optimizer=optimizer
        ) as p:
            for step in range(t.steps):
                losses.append(p.train_batch(*data.batch(step, cfg.data.batch_size)).loss)
    finally:
        torch.set_num_threads(threads)
    assert losses == pytest.approx(reference(cfg)[0], rel=1e-5)


def test_tokenize_reads_the_split_it_is_given(tmp_path, tokenizer_dir, capsys):
    """A held-out file tokenized from a datasets folder of several splits takes --split (default train, said in the
    summary): without it, `-o val.bin` held the train split, and evaluation ran on the training data."""
    import datasets

    folder = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    train, held = _docs(6, 300), _docs(3, 44)
    splits = {"train": train, "validation": held}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_list([{"text": d} for d in v]) for k, v in splits.items()}
    ).save_to_disk(str(tmp_path / "ds"))
    base = ["tokenize", "--tokenizer", str(folder), "--input", str(tmp_path / "ds")]
    assert main([*base, "-o", str(tmp_path / "val.bin"), "--split", "validation"]) == 0
    assert np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == _direct(folder, held, "<|endoftext|>")
    assert "split validation" in capsys.readouterr().out
    assert main([*base, "-o", str(tmp_path / "none.bin"), "--split", "test"]) == 2
    assert "a split 'test' in the datasets folder" in (err := capsys.readouterr().err) and "--split" in err


def test_a_text_file_too_large_to_tokenize_whole_is_refused_before_it_is_read(tmp_path, tokenizer_dir, monkeypatch):
    """A text file is one document, and the tokenizer holds some 490 bytes a token of it: a corpus too large for the
    host's memory was read and encoded until the kernel killed the process without a word."""
    import mobiuspipe.data.tokenizer as tokenizer_module

    folder = tokenizer_dir(tmp_path / "tok", eos="<|endoftext|>")
    (tmp_path / "corpus.txt").write_text("the quick brown fox " * 500)  # 10,000 bytes: about 1 MB to tokenize
    monkeypatch.setattr(tokenizer_module, "mem_available", lambda: 1 << 19)
    out = tmp_path / "o.bin"
    assert main(["tokenize", "--tokenizer", str(folder), "--input", str(tmp_path / "corpus.txt"), "-o", str(out)]) == 2
    with pytest.raises(Exception, match=r"a text file whose one document the tokenizer can hold in memory.*JSONL"):
        tokenizer_module.tokenize_file(load_tokenizer(str(folder)), str(tmp_path / "corpus.txt"), "text", "--input")
    monkeypatch.setattr(tokenizer_module, "mem_available", lambda: 1 << 30)
    assert main(["tokenize", "--tokenizer", str(folder), "--input", str(tmp_path / "corpus.txt"), "-o", str(out)]) == 0
