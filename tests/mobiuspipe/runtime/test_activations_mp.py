"""Activation modes on 2 ranks under torchrun (gloo on CPU): recompute, keep and selective give the same losses
and weights bit for bit, with dropout, accumulation, in fp32 and bf16; memory.activations and
memory.activation_tier reach the runtime through the torchrun entry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parents[1] / "activations_worker.py"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_mode_trains_bit_identical_on_two_ranks(tmp_path, precision):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*cmd, str(WORKER), precision, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        base = results.pop("recompute")
        assert base["weights"]  # each rank holds two of the four stages
        for name, r in results.items():
            assert r["losses"] == base["losses"], (rank, name)
            assert r["weights"].keys() == base["weights"].keys()
            assert all(torch.equal(r["weights"][k], base["weights"][k]) for k in base["weights"]), (rank, name)
        assert max(results["keep"]["peaks"]) > max(base["peaks"])


def _train(launch, tmp_path: Path, name: str, memory: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    write_config, torchrun = launch
    out = tmp_path / name
    out.mkdir()
    cfg = write_config(
        out,
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 19},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "train": {"steps": 3, "lr": 0.01, "seed": 3, "accumulation_steps": 2, "out_dir": str(out / "run")},
            "plan": {"num_gpus": 2, "num_stages": 4, "mapping": "cross"},
            "memory": memory,
            "runtime": {"comm_timeout_s": 60},
        },
    )
    proc = torchrun(cfg, 2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((out / "run" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return losses, weights


def test_memory_activations_and_tiers_under_torchrun(launch, tmp_path):
    """The torchrun entry: the plan's choice (the default), a recompute stage's input swapped to SSD and to the other
    rank's memory (the peer tier, staged), and kept graphs on the peer and on SSD (SO / SI in both ranks' schedules)
    all equal recompute on the device, bit for bit; the peer regions' shared memory files are gone after. (keep on
    the device and the host tier, on one rank: test_activation_tiers.py; keep on two: the test above.)"""
    before = _regions()
    losses, weights = _train(launch, tmp_path, "recompute", {"activations": "recompute", "activation_tier": "device"})
    runs = {
        "plan": {},
        "ssd": {"activations": "recompute", "activation_tier": "ssd", "ssd_dir": str(tmp_path / "ssd")},
        "peer": {"activations": "recompute", "activation_tier": "peer"},
        "keep-peer": {"activations": "keep", "activation_tier": "peer"},
        "keep-ssd": {"activations": "keep", "activation_tier": "ssd", "ssd_dir": str(tmp_path / "ssd2")},
    }
    for name, memory in runs.items():
        got_losses, got_weights = _train(launch, tmp_path, name, memory)
        assert got_losses == losses and len(losses) == 3, name
        assert got_weights.keys() == weights.keys()
        assert all(torch.equal(got_weights[k], weights[k]) for k in weights), name
    left = _regions() - before
    deadline = time.monotonic() + 90  # a region of a test running beside this one (pytest -n) goes when it ends
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left &= _regions()
    assert not left, left


def _regions() -> set[str]:
    """The peer regions' shared memory files (mobiuspipe.startup.peer_regions) that exist now."""
    return {p.name for p in Path("/dev/shm").glob("mobiuspipe-*")} if Path("/dev/shm").is_dir() else set()
