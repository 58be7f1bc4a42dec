"""Fixtures of the runtime tests: plain single-process PyTorch training, the yardstick the pipeline must equal."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from mobiuspipe.config import RunConfig
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import build_layers, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.host_threads import rank_threads
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def reference_run(
    cfg: RunConfig, microbatched: bool = True, optimizer=CPUAdam
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of every step and the final weights by "layer.param", with no pipeline.

    microbatched=True accumulates the gradients of loss_i / M over the same microbatches as the pipeline
    (plain gradient accumulation); False takes one full-batch gradient. Both are the same step in exact
    arithmetic; the first also rounds like the pipeline, which matters where the true gradient is zero
    (the attention key bias): Adam's m / sqrt(v) turns rounding noise there into full-size updates.
    The optimizer is the runtime's (CPUAdam, a drop-in for AdamW) so both sides round alike; the loss
    checks also run against torch.optim.AdamW.
    """
    threads = torch.get_num_threads()
    ranks = plan_for_config(cfg).num_gpus  # the ranks' thread count (each its share of the cores), so sums round alike
    torch.set_num_threads(rank_threads(cfg.runtime.threads, ranks))
    try:
        return _reference_run(cfg, microbatched, optimizer)
    finally:
        torch.set_num_threads(threads)


def _reference_run(cfg: RunConfig, microbatched: bool, optimizer) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = model_spec(cfg)
    layers = build_layers(spec, cfg.train.seed)
    model = nn.Sequential(*(layers[l] for l in range(spec.num_layers)))
    t = cfg.train
    opt = optimizer(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    losses = []
    for step in range(cfg.train.steps):
        x, y = data.batch(step, cfg.data.batch_size)
        for group in opt.param_groups:
            group["lr"] = cfg.train.lr_of(step)
        opt.zero_grad()
        chunks = (cfg.data.num_microbatches or plan_for_config(cfg).num_microbatches) if microbatched else 1
        total = 0.0
        for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = lm_loss(model(xi), yi) / chunks
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    weights = {
        f"{l}.{name}": p.detach().clone() for l in range(spec.num_layers) for name, p in layers[l].named_parameters()
    }
    return losses, weights


@pytest.fixture
def reference():
    """reference_run(cfg) -> (losses, weights)."""
    return reference_run


def write_config(tmp_path: Path, d: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def torchrun(config: Path, nproc: int, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc -m mobiuspipe.train --config config`, bounded in time."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "mobiuspipe.train",
        "--config",
        str(config),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def launch():
    """(write_config, torchrun) helpers."""
    return write_config, torchrun


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_rank(cmd: list[str], rank: int, world: int, port: int) -> subprocess.Popen:
    """One rank of a job started without torchrun (whose agent would end the job itself when a rank dies): cmd with
    the variables torchrun sets, its output piped as text."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def by_hand():
    """(free_port, spawn_rank) helpers: the ranks of a job started without torchrun."""
    return free_port, spawn_rank


def _load_helper(file: str):
    """A helper module beside this file (tests are imported with --import-mode=importlib: not on sys.path)."""
    name = f"mobiuspipe_test_{Path(file).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
        assert spec is not None and spec.loader is not None  # a .py path always has a source loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _load_hf_fixtures():
    return _load_helper("hf_fixtures.py")


@pytest.fixture
def act_runs():
    """The activation_runs module: config(), layers(), choices(), run(), rotate_slots()."""
    return _load_helper("activation_runs.py")


@pytest.fixture
def hf_kit():
    """The hf_fixtures module: VOCAB, hf_config(), save_model(), train_plain(), random_batches()."""
    return _load_hf_fixtures()


def events_equal_metrics(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Read folder's TensorBoard event files (tensorboard's EventAccumulator) and require every scalar to be
    the value of its metrics.jsonl record at its step, as float32: tag GROUP/KEY is the record's KEY, rank{r}/KEY
    the record's ranks[r][KEY]. Returns tag -> [(step, value)]."""
    import json

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    events = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for tag, points in events.items():
        group, key = tag.split("/")
        kind = "eval" if group == "eval" else "train"
        want = []
        for rec in records:
            if rec["kind"] == kind:
                source = rec["ranks"][int(group[4:])] if group.startswith("rank") else rec
                if source.get(key) is not None:
                    want.append((rec["step"], float(np.float32(source[key]))))
        assert points == want, tag
    return events


@pytest.fixture
def read_events():
    """events_equal_metrics(folder) -> tag -> [(step, value)], after checking them against metrics.jsonl."""
    return events_equal_metrics


CORPUS = [
    "the cat sat on the mat",
    "a quick brown fox jumps over the lazy dog",
    "pipelines stream weights from the host, stage by stage",
    "Ünïcode wörds and numbers 12345 too",
]
"""Lines a test tokenizer is trained on."""


def build_tokenizer(
    folder: Path, *, specials=("<|endoftext|>",), eos: str | None = None, vocab_size: int = 300
) -> Path:
    """A byte-level BPE tokenizer trained on CORPUS, saved into `folder` as save_pretrained writes it
    (tokenizer.json, and tokenizer_config.json naming `eos` when given); `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 3, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    if eos is None:
        tok.save(str(folder / "tokenizer.json"))
    else:
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(str(folder))
    return folder


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
"""A chat template: each message as <|role|>content<|end|>."""


def build_chat_tokenizer(folder: Path) -> Path:
    """build_tokenizer's BPE with the chat roles as special tokens, CHAT_TEMPLATE, and <|endoftext|> as its
    end-of-text token, saved by save_pretrained into `folder`; `folder`."""
    from transformers import AutoTokenizer

    specials = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    build_tokenizer(folder, specials=specials, eos="<|endoftext|>")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture
def chat_tokenizer_dir():
    """build_chat_tokenizer(folder) -> folder."""
    return build_chat_tokenizer


@pytest.fixture
def tokenizer_dir():
    """build_tokenizer(folder, specials=..., eos=..., vocab_size=...) -> folder."""
    return build_tokenizer
