"""A run killed in the middle of training (SIGKILL: no clean-up at all) leaves nothing in its SSD folder
that the next run would take as valid states: the next run starts afresh there and trains exactly as it
would in an empty folder."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mobiuspipe.memory.store.ssd_store import SSDStore

CHILD = textwrap.dedent(
    """
    import json, sys
    from functools import partial
    import torch
    from mobiuspipe import Pipeline
    from mobiuspipe.config import MemoryConfig, config_from_dict
    from mobiuspipe.startup.config_plan import model_spec, plan_for_config
    from mobiuspipe.data.dataset import open_data
    from mobiuspipe.models.gpt import layer_factories, lm_loss
    from mobiuspipe.optim import CPUAdam

    folder, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    cfg = config_from_dict({
        "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
        "data": {"batch_size": 6, "num_microbatches": 3},
        "train": {"precision": "bf16", "lr": 0.01, "seed": 5},
        "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
    })
    memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=folder, host_budget_mb=0.25)
    data = open_data(cfg.data, cfg.model.seq_len, 5, cfg.model.vocab_size)
    opt = partial(CPUAdam, lr=0.01, weight_decay=0.05)
    layers = layer_factories(model_spec(cfg), 5)
    with Pipeline(layers, lm_loss, plan=plan_for_config(cfg), optimizer=opt, memory=memory) as pipe:
        for s in range(steps):
            print(json.dumps(pipe.train_batch(*data.batch(s, 6)).loss), flush=True)
    """
)


def _run(folder: str, steps: int) -> list[float]:
    out = subprocess.run([sys.executable, "-c", CHILD, folder, str(steps)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.split()]


@pytest.mark.slow
def test_a_killed_run_leaves_nothing_valid_behind(tmp_path):
    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, killed, "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        for _ in range(3):  # killed in its fourth step, with updates and store writes in flight
            assert proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    folder = os.path.join(killed, "rank0")
    assert any(name.endswith(".bin") for name in os.listdir(folder))  # it had written states
    with SSDStore(folder) as store:  # the lock died with the process; no index was ever saved
        assert store.meta == {} and store.keys() == []
    fresh = _run(str(tmp_path / "fresh"), 3)
    assert _run(killed, 3) == fresh  # the next run starts afresh there, bit for bit as in an empty folder
    assert _run(killed, 3) == fresh  # and after a run that ended cleanly (its states discarded: runs resume
    # from their checkpoints)
