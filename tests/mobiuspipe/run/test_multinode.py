"""`mobiuspipe train` across machines: the torchrun command of each node, its errors, and two "nodes" on this
machine (c10d rendezvous on localhost, one rank each) training exactly as one node with two ranks."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mobiuspipe.cli import main as cli
from mobiuspipe.cli._common import CliError
from mobiuspipe.cli.train import torchrun_command


def _args(**kw) -> argparse.Namespace:
    d = {"nnodes": 1, "node_rank": 0, "rdzv_endpoint": None, "rdzv_id": "mobiuspipe", "local_addr": None}
    d |= {"resume": None, "max_restarts": 0} | kw
    return argparse.Namespace(**d)


def test_one_node_is_standalone():
    cmd = torchrun_command("run.yaml", 4, _args())
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone"] + [
        "-m",
        "mobiuspipe.train",
        "--config",
        "run.yaml",
    ]


def test_each_node_starts_its_share_through_the_rendezvous():
    cmd = torchrun_command("run.yaml", 8, _args(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", rdzv_id="j7"))
    flags = " ".join(cmd[3 : cmd.index("-m", 3)])
    assert flags == (
        "--nnodes 2 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400 --rdzv_id j7 --nproc_per_node 4"
    )
    assert "--standalone" not in cmd
    cmd = torchrun_command("run.yaml", 2, _args(nnodes=2, rdzv_endpoint="b:1", local_addr="10.0.0.2"))
    assert cmd[cmd.index("--local_addr") + 1] == "10.0.0.2"


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"nnodes": 3, "rdzv_endpoint": "h:1"}, "the plan has 8 gpus (ranks), which --nnodes 3 does not divide"),
        ({"nnodes": 2}, "--nnodes > 1 needs --rdzv-endpoint HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "10.0.0.1"}, "--rdzv-endpoint must be HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "h:70000"}, "with a port in 1..65535"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank must be in 0 .. 1 (--nnodes 2), found 2"),
        ({"node_rank": 1}, "--node-rank is 1 on a job of one node"),
    ],
)
def test_node_options_that_do_not_fit(kw, message):
    with pytest.raises(CliError, match=re.escape(message)):
        torchrun_command("run.yaml", 8, _args(**kw))


def test_the_cli_refuses_before_launching(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("plan: {num_gpus: 3, num_stages: 3}\n")
    code = cli(["train", "--config", str(path), "--nnodes", "2", "--rdzv-endpoint", "localhost:29400"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("mobiuspipe: error: the plan has 3 gpus (ranks), which --nnodes 2 does not divide")
    assert "launching" not in err


def _config(folder, write_config) -> str:
    folder.mkdir()
    model = {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 16}
    train = {"steps": 3, "precision": "fp32", "out_dir": str(folder / "out"), "tensorboard": False}
    runtime = {"threads": 1}  # two hosts of one rank take every core each by default: the same threads as one host
    doc = {"model": model, "train": train, "plan": {"num_gpus": 2, "num_stages": 4}, "runtime": runtime}
    return str(write_config(folder, doc))


def _train(config: str, *node: str) -> subprocess.Popen:
    """A launch whose temporary files go to TMPDIR, the folder `tmp` beside its config (made)."""
    tmp = Path(config).parent / "tmp"
    tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", config, *node]
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every launch's output, each having exited 0; on a timeout the launches and their ranks are killed."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # the session start_new_session made: torchrun and its ranks
        raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _run(folder) -> tuple[list[float], dict[str, torch.Tensor]]:
    out = folder / "out"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((out / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return losses, weights


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_train_as_one_node_with_two_ranks(tmp_path, launch, by_hand):
    write_config, _ = launch
    one, two = _config(tmp_path / "one", write_config), _config(tmp_path / "two", write_config)
    _finish([_train(one)], 120)
    endpoint = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{by_hand[0]()}", "--rdzv-id", "test"]
    outs = _finish([_train(two, *endpoint, "--node-rank", str(r)) for r in (0, 1)], 120)
    assert all("--nproc_per_node 1 " in out and "--rdzv_backend c10d" in out for out in outs)
    assert sum("step 2 [3/3]" in out for out in outs) == 1  # rank 0 reports, on whichever node it is
    (losses, weights), (ref_losses, ref_weights) = _run(tmp_path / "two"), _run(tmp_path / "one")
    assert len(losses) == 3 and losses == ref_losses  # the same ranks, plan and arithmetic: bit for bit
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)
    # no folder of the launch's left in TMPDIR (torchrun made a torchelastic_* one a launch and kept it); torch's
    # caches (torchinductor_USER, which importing torchao makes) stay, as they do for any torch program
    left = [p.name for run in ("one", "two") for p in (tmp_path / run / "tmp").iterdir()]
    assert [name for name in left if not name.startswith("torchinductor_")] == []


def test_resume_and_restarts_reach_torchrun_and_the_entry():
    cmd = torchrun_command("run.yaml", 2, _args(resume="auto", max_restarts=3))
    assert cmd[cmd.index("--max-restarts") + 1] == "3" and cmd.index("--max-restarts") < cmd.index("-m", 3)
    assert cmd[-2:] == ["--resume", "auto"]
