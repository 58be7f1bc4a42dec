"""Tests of the run config: loading, defaults, round trip, and every kind of error it reports."""

import ast
import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import pytest

from foundation.loader import InvalidValues
from mobiuspipe.config import (
    DataConfig,
    MemoryConfig,
    ModelConfig,
    PlanConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
    config_from_dict,
    load_config,
)
from mobiuspipe.errors import ConfigError
from topology import preset, save_topology

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-gpt.yaml"


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = write(tmp_path, text, name)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert name in message
    return message


def test_example_loads_with_expected_values():
    cfg = load_config(EXAMPLE)
    assert cfg.source == str(EXAMPLE)
    assert cfg.model == ModelConfig(vocab_size=256, num_blocks=6, d_model=64, num_heads=4, seq_len=64)
    assert cfg.data == DataConfig(path=None, batch_size=8, num_microbatches=None)
    assert cfg.train == TrainConfig(
        steps=20, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, seed=0, log_every=1, out_dir=None
    )
    assert cfg.plan == PlanConfig(file=None, num_gpus=2, num_stages=None, mapping="cross", device_memory_mb=64.0)
    assert cfg.runtime == RuntimeConfig(comm_timeout_s=60.0, threads=None)
    assert cfg.num_layers == 8 and cfg.microbatch_size is None  # the planner chooses it
    assert cfg.data.text_path.endswith("sample.txt")


def test_sections_are_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_every_field_has_a_docstring():
    for cls in (ModelConfig, DataConfig, TrainConfig, PlanConfig, MemoryConfig, RuntimeConfig, RunConfig):
        source = Path(inspect.getsourcefile(cls) or "")
        classes = {n.name: n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)}
        body = classes[cls.__name__].body
        documented = {
            stmt.target.id
            for stmt, nxt in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        }
        for f in dataclasses.fields(cls):
            assert f.name in documented, f"{cls.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "model: {}\ntrain:\n"])
def test_defaults_when_sections_omitted(tmp_path, text):
    cfg = load_config(write(tmp_path, text))
    assert cfg == RunConfig(source=str(tmp_path / "run.yaml"))
    assert cfg.train.steps == 20 and cfg.plan.mapping == "cross"


def test_partial_section_keeps_other_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  steps: 5\n  lr: 1\n"))
    assert cfg.train.steps == 5
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # an int is fine for a float
    assert cfg.train.betas == (0.9, 0.95) and cfg.model == ModelConfig()


def test_exponent_without_dot_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  lr: 3e-3\n  eps: 1e-6\n"))
    assert cfg.train.lr == 0.003 and cfg.train.eps == 1e-6


def test_round_trip(tmp_path):
    (tmp_path / "text.txt").write_text("hello")
    cfg = load_config(
        write(
            tmp_path,
            "data: {path: text.txt, batch_size: 6, num_microbatches: 3}\n"
            "train: {betas: [0.5, 0.75], out_dir: runs/x}\n",
        )
    )
    plain = cfg.to_dict()
    assert "source" not in plain and plain["train"]["betas"] == [0.5, 0.75]
    assert config_from_dict(plain, source=cfg.source) == cfg
    assert RunConfig.from_dict(RunConfig().to_dict(), "<defaults>") == RunConfig()
    yaml_path = write(tmp_path, cfg.to_yaml(), "resolved.yaml")
    assert load_config(yaml_path).to_dict() == plain


def test_relative_paths_resolve_against_config_folder(tmp_path, monkeypatch):
    """Every path of a config file, read or written, starts at the file's folder, whatever the current one."""
    folder = tmp_path / "configs"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "text.txt").write_text("abc")
    (folder / "plan.yaml").write_text("stages: []\n")
    save_topology(preset("2+2"), folder / "server.yaml")
    hf = Path(__file__).resolve().parents[2] / "partition" / "data" / "tiny-gpt2"  # a config.json to read
    path = write(
        folder,
        f"model:\n  hf: {hf}\n  seq_len: 16\n"
        "data:\n  path: data/text.txt\nplan:\n  file: plan.yaml\n  topology: server.yaml\n  num_stages: 4\n"
        "train:\n  out_dir: runs\n  export_dir: ../exported\n"
        "memory:\n  optimizer: ssd\n  ssd_dir: swap/job\n",
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path.relative_to(tmp_path))
    assert cfg.data.path == str(folder / "data" / "text.txt")
    assert cfg.plan.file == str(folder / "plan.yaml") and cfg.plan.topology == str(folder / "server.yaml")
    assert cfg.data.text_path == cfg.data.path
    assert cfg.train.out_dir == str(folder / "runs") and cfg.train.export_dir == str(tmp_path / "exported")
    assert cfg.memory.ssd_dir == str(folder / "swap" / "job")  # written paths need not exist yet
    assert not (folder / "runs").exists() and not (folder / "swap").exists()
    assert cfg.source == str(path)


def test_written_paths_expand_home_and_keep_presets_and_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(tmp_path, "plan: {topology: 2+2}\ntrain: {out_dir: ~/runs/x}\nmemory: {ssd_dir: /nvme/job}\n")
    cfg = load_config(path)
    assert cfg.train.out_dir == str(tmp_path / "home" / "runs" / "x") and cfg.memory.ssd_dir == "/nvme/job"
    assert cfg.plan.topology == "2+2"  # a preset name is not a path
    assert "train.out_dir: expected a folder name or null" in load_error(tmp_path, "train: {out_dir: ''}\n")
    message = load_error(tmp_path, "plan: {topology: layouts/box.yaml}\n")
    assert "plan.topology: expected an existing file" in message and str(tmp_path / "layouts" / "box.yaml") in message
    assert "mobiuspipe topology --save FILE.yaml" in message


def test_a_config_from_a_dict_takes_paths_from_base_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_dict({"train": {"out_dir": "runs"}}).train.out_dir == str(tmp_path / "runs")
    other = config_from_dict({"train": {"out_dir": "runs"}}, base_dir=str(tmp_path / "b"))
    assert other.train.out_dir == str(tmp_path / "b" / "runs")


def test_missing_relative_path_names_key_and_resolved_path(tmp_path):
    message = load_error(tmp_path, "data:\n  path: nope.txt\nplan:\n  file: plan.yaml\n")
    assert "data.path" in message and str(tmp_path / "nope.txt") in message
    fix = "mobiuspipe partition --config RUN.yaml -o FILE` while RUN.yaml has no plan.file, then set plan.file"
    assert "plan.file" in message and fix in message


def test_unknown_key_suggests_closest(tmp_path):
    message = load_error(tmp_path, "train:\n  lrr: 0.1\n")
    assert "train.lrr" in message and "did you mean 'lr'" in message
    assert "steps, lr, lr_schedule, warmup_steps, min_lr, betas, eps, weight_decay, max_grad_norm" in message


def test_unknown_section_suggests_closest(tmp_path):
    message = load_error(tmp_path, "trian:\n  steps: 3\n")
    assert "trian" in message and "did you mean 'train'" in message


def test_source_is_not_a_yaml_key(tmp_path):
    assert "unknown key 'source'" in load_error(tmp_path, "source: x.yaml\n")


@pytest.mark.parametrize(
    "text, key, hint",
    [
        ("model:\n  d_model: '64'\n", "model.d_model", "remove the quotes"),
        ("train:\n  lr: fast\n", "train.lr", "expected a number"),
        ("train:\n  steps: 2.5\n", "train.steps", "expected an integer"),
        ("plan:\n  mapping: 3\n", "plan.mapping", "expected a string"),
        ("train:\n  betas: [0.9]\n", "train.betas", "a list of 2 numbers"),
        ("train:\n  betas: 0.9\n", "train.betas", "a list of 2 numbers"),
        ("data:\n  path: 7\n", "data.path", "a string or null"),
        ("train: 5\n", "train", "expected a mapping"),
    ],
)
def test_wrong_type(tmp_path, text, key, hint):
    message = load_error(tmp_path, text)
    assert key in message and hint in message and "fix:" in message


@pytest.mark.parametrize(
    "text, key",
    [
        ("model:\n  num_blocks: true\n", "model.num_blocks"),
        ("train:\n  lr: false\n", "train.lr"),
    ],
)
def test_bool_is_not_a_number(tmp_path, text, key):
    message = load_error(tmp_path, text)
    assert key in message and "found boolean" in message


@pytest.mark.parametrize(
    "section, values, key, found",
    [
        ("train", "lr: 0", "train.lr", "0.0"),
        ("train", "lr: -0.1", "train.lr", "-0.1"),
        ("train", "lr: .nan", "train.lr", "nan"),
        ("train", "weight_decay: -0.01", "train.weight_decay", "-0.01"),
        ("train", "eps: -1.0e-8", "train.eps", "-1e-08"),
        ("train", "betas: [0.9, 1.0]", "train.betas", "[0.9, 1.0]"),
        ("train", "betas: [-0.1, 0.9]", "train.betas", "[-0.1, 0.9]"),
        ("train", "steps: 0", "train.steps", "0"),
        ("data", "batch_size: 0", "data.batch_size", "0"),
        ("data", "num_microbatches: 0", "data.num_microbatches", "0"),
        ("data", "batch_size: 6\n  num_microbatches: 4", "data.batch_size", "batch_size 6 with num_microbatches 4"),
        ("data", "num_microbatches: many", "data.num_microbatches", "'many'"),
        ("model", "d_model: 66", "model.d_model", "d_model 66 with num_heads 4"),
        ("plan", "num_gpus: 0", "plan.num_gpus", "0"),
        ("plan", "num_gpus: 3\n  num_stages: 2", "plan.num_stages", "more gpus than stages"),
        ("plan", "num_stages: 9", "plan.num_stages", "9 stages for 8 layers"),
        ("plan", "mapping: ring", "plan.mapping", "'ring'"),
        ("plan", "device_memory_mb: 0", "plan.device_memory_mb", "0.0"),
        ("runtime", "comm_timeout_s: -1", "runtime.comm_timeout_s", "-1.0"),
        ("runtime", "hang_timeout_s: 10", "runtime.hang_timeout_s", ">= comm_timeout_s (60)"),
        ("runtime", "threads: 0", "runtime.threads", "0"),
        ("model", "vocab_size: 0", "model.vocab_size", "0"),
        ("model", "vocab_size: 65537", "model.vocab_size", "65537"),
    ],
)
def test_impossible_value(tmp_path, section, values, key, found):
    message = load_error(tmp_path, f"{section}:\n  {values}\n")
    assert key in message and found in message and "fix:" in message
    assert message.count("\n") == 0  # one problem, one line


def test_divisibility_messages_give_both_numbers_and_a_fix(tmp_path):
    message = load_error(tmp_path, "data:\n  batch_size: 6\n  num_microbatches: 4\n")
    assert "6 % 4 = 2" in message and "batch_size 8" in message and "num_microbatches 3" in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="absent.yaml.*not found"):
        load_config(tmp_path / "absent.yaml")


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)


def test_bad_yaml_names_file_and_line(tmp_path):
    message = load_error(tmp_path, "train:\n  lr: [0.1\n  steps: 3\n")
    assert "expected valid YAML" in message and "line" in message


def test_duplicate_key(tmp_path):
    message = load_error(tmp_path, "train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    assert "train.lr" in message and "line 2" in message and "line 4" in message


def test_duplicate_section(tmp_path):
    message = load_error(tmp_path, "train:\n  lr: 0.1\ntrain:\n  steps: 3\n")
    assert "train" in message and "line 3" in message


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    message = load_error(tmp_path, text)
    assert "(top level)" in message and "expected a mapping" in message


def test_several_errors_reported_together(tmp_path):
    message = load_error(
        tmp_path,
        "model:\n  num_blockz: 4\n  d_model: 66\ntrain:\n  lr: -1\n"
        "  eps: -1\ndata:\n  batch_size: 0\nruntime:\n  threads: true\n"
        "plan:\n  mapping: ring\n",
    )
    assert message.count("\n") == 0  # one line, as the CLI prints it
    head, *items = re.split(r" \(\d+\) ", message)
    assert head.endswith("7 errors:") and "run.yaml" in head and len(items) == 7
    for key in (
        "model.num_blockz",
        "model.d_model",
        "train.lr",
        "train.eps",
        "data.batch_size",
        "runtime.threads",
        "plan.mapping",
    ):
        assert sum(item.startswith(key + ": expected") for item in items) == 1, key
    assert "did you mean 'num_blocks'" in message


def test_type_errors_of_a_section_come_before_its_value_checks(tmp_path):
    message = load_error(tmp_path, "train:\n  lr: -1\n  steps: '3'\n")
    assert "train.steps" in message and "train.lr" not in message  # lr is checked once types are right


def test_config_from_dict_errors_name_source():
    with pytest.raises(ConfigError, match=r"config my-source: train\.lr"):
        config_from_dict({"train": {"lr": "x"}}, source="my-source")
    with pytest.raises(ConfigError, match=r"\(top level\)"):
        config_from_dict(None)


def test_direct_construction_is_checked():
    with pytest.raises(ConfigError, match="ModelConfig: d_model"):
        ModelConfig(d_model=65)
    with pytest.raises(ConfigError, match="expected a list of 2 numbers"):
        TrainConfig(betas=(0.9,))  # type: ignore[arg-type]
    assert TrainConfig(betas=[0.5, 0.5]).betas == (0.5, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="plan.num_stages"):
        RunConfig(model=ModelConfig(num_blocks=1), plan=PlanConfig(num_stages=4))


def test_invalid_values_pickles():
    with pytest.raises(InvalidValues) as info:
        RuntimeConfig(threads=0)
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.problems == info.value.problems


def test_evaluation_needs_held_out_data(tmp_path):
    for train in ({"eval_every": 5}, {"eval_at_start": True}):
        with pytest.raises(ConfigError) as e:
            config_from_dict({"train": train})
        key = "train.eval_every" if "eval_every" in train else "train.eval_at_start"
        assert f"{key}: expected held-out data (data.eval_path) to evaluate on" in str(e.value)
    with pytest.raises(ConfigError, match=r"train.eval_batches: expected a count >= 1 or null \(every full"):
        config_from_dict({"train": {"eval_batches": 0}})
    with pytest.raises(ConfigError, match=r"train.eval_every: expected an integer >= 0, found integer -1"):
        config_from_dict({"train": {"eval_every": -1}})


def test_checkpoints_need_a_folder_and_sane_counts():
    for train in ({"checkpoint_every": 5}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match=r"expected a folder for the checkpoints \(train.out_dir or"):
            config_from_dict({"train": train})
    cfg = config_from_dict({"train": {"checkpoint_every": 5, "out_dir": "/r/x"}})
    assert cfg.train.checkpoint_root == "/r/x/checkpoints"
    assert config_from_dict({"train": {"checkpoint_dir": "/ck", "resume": "auto"}}).train.checkpoint_root == "/ck"
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints: expected an integer >= 1, found integer 0"):
        config_from_dict({"train": {"keep_checkpoints": 0}})


def test_shape_keys_beside_an_hf_model_are_an_error_not_ignored(tmp_path, hf_kit):
    """model.hf takes its shape from config.json: a num_blocks, d_model, num_heads or vocab_size beside it would be
    silently ignored, so the config is refused, naming them and the two ways out."""
    from mobiuspipe.config import config_from_dict
    from mobiuspipe.errors import ConfigError

    hf_kit.save_model("gpt2", tmp_path / "m")
    assert config_from_dict({"model": {"hf": str(tmp_path / "m"), "seq_len": 16}}).model.hf  # alone: fine
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hf": str(tmp_path / "m"), "num_blocks": 3, "vocab_size": 1000}})
    text = str(e.value)
    assert "model.vocab_size: expected no vocab_size or num_blocks beside model.hf" in text
    assert "found vocab_size: 1000, num_blocks: 3" in text and "or drop model.hf" in text


def test_a_host_budget_with_every_state_on_host_is_refused_as_unread():
    from mobiuspipe.config import config_from_dict
    from mobiuspipe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"memory.host_budget_mb: expected no host_budget_mb while optimizer and"):
        config_from_dict({"memory": {"host_budget_mb": 512}})
    assert config_from_dict({"memory": {"host_budget_mb": 512, "optimizer": "auto", "ssd_dir": "s"}}).memory
    assert config_from_dict({"memory": {}}).memory.host_budget_mb == 1024.0  # the default, unread: no error
