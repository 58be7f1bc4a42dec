"""Optimizer states on SSD (memory.optimizer: ssd) move tensors, not math: the pipelined run's losses and
weights are bit-identical to the same run with the states in host memory, in fp32 and in bf16."""

from __future__ import annotations

import dataclasses
import errno
import json
from functools import partial

import pytest
import torch

from foundation.units import MiB, fmt_bytes
from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict, load_config
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import ConfigError, PipelineError, SwapIOError
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.run.run_lock import LOCK_FILE
from mobiuspipe.runtime.states import least_share
from mobiuspipe.startup.config_plan import model_spec, plan_for_config
from partition.errors import PlanInfeasibleError
from partition.rules.placement import FROZEN_STREAM_BYTES, LEAST_SHARE_BYTES
from partition.rules.tiers import HostBudget, host_held_bytes, place_tiers


def _run(
    precision: str,
    memory: MemoryConfig | None,
    steps: int = 3,
    overlap: bool = True,
    planned: MemoryConfig | None = None,
):
    """Train the small GPT for `steps` steps with `memory`, on a plan made for it (or for the `planned` settings)."""
    torch.set_num_threads(1)
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": steps, "lr": 0.01, "weight_decay": 0.05, "seed": 5, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )
    t = cfg.train
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    # fp16: scales of 2^40 and 2^28 overflow, so the first two steps are skipped (on both tiers alike)
    scaler = LossScaler(scale=2.0**40, backoff_factor=2.0**-12, growth_interval=2) if precision == "fp16" else None
    with Pipeline(
        layer_factories(model_spec(cfg), t.seed),
        lm_loss,
        plan=plan_for_config(dataclasses.replace(cfg, memory=planned or memory or MemoryConfig())),
        optimizer=opt,
        memory=memory,
        loss_scaler=scaler,
        overlap_updates=overlap,
    ) as pipe:
        results = [pipe.train_batch(*data.batch(s, 6)) for s in range(steps)]
        losses = [(r.loss, r.skipped) for r in results]
        return losses, pipe.state_dict(), pipe.placement, pipe.plan


def test_the_planners_least_share_is_the_runtimes():
    """partition.rules.placement.LEAST_SHARE_BYTES (what the planner assumes) is what the runtime derives from its
    out-of-core Adam's group layout and weight-stream buffers, for every training dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert least_share(dtype.itemsize) == LEAST_SHARE_BYTES


def test_the_planners_frozen_stream_share_is_the_runtimes(tmp_path):
    """FROZEN_STREAM_BYTES (the host memory the planner gives a stage whose frozen weights are on the SSD) is what
    SsdFrozenWeights' staging buffers take; the bytes come back as they went in (an odd size: a short record)."""
    from mobiuspipe.memory.aio import aligned_empty
    from mobiuspipe.memory.store.ssd_store import SSDStore
    from mobiuspipe.runtime.frozen import SsdFrozenWeights

    flat = torch.randint(0, 256, (3 * MiB + 5,), dtype=torch.uint8)
    store = SSDStore(str(tmp_path / "store"))
    try:
        frozen = SsdFrozenWeights(flat, store, "stage0", aligned_empty)
        assert sum(b.nbytes for b in frozen.records.buffers) == FROZEN_STREAM_BYTES
        assert torch.equal(frozen.read(), flat)
    finally:
        store.close()


@pytest.mark.parametrize("weights", ["host", "ssd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_states_on_ssd_are_bit_identical_to_host(tmp_path, precision, weights):
    host_losses, host_weights, *_ = _run(precision, None)
    # ~8k parameters per stage: each stage's share (64 KiB and up) streams it in groups of 1024 elements;
    # with the weights in memory, 4 stages x 8k x (4 + 4) bytes of weights and gradients stay there too
    budget = 0.25 if weights == "ssd" else 0.6
    memory = MemoryConfig(optimizer="ssd", weights=weights, ssd_dir=str(tmp_path), host_budget_mb=budget)
    ssd_losses, ssd_weights, placement, _ = _run(precision, memory)
    assert set(placement.weights.values()) == {weights}
    assert ssd_losses == host_losses
    assert [skipped for _, skipped in ssd_losses] == ([True, True, False] if precision == "fp16" else [False] * 3)
    assert ssd_weights.keys() == host_weights.keys()
    for k in host_weights:
        assert torch.equal(ssd_weights[k], host_weights[k]), k
    index = json.dumps(json.loads((tmp_path / "rank0" / "index.json").read_text()))
    assert "stage0/g" in index  # the states really went to the store
    assert ("stage0/lowp/w" in index and "stage0/lowp/d" in index) == (weights == "ssd")


def test_ssd_tier_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="memory.ssd_dir: expected a folder when optimizer is ssd or auto"):
        config_from_dict({"memory": {"optimizer": "ssd"}})
    with pytest.raises(ConfigError, match="memory.optimizer: expected one of host, ssd, auto"):
        config_from_dict({"memory": {"optimizer": "nvme"}})
    first = _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    with pytest.warns(UserWarning, match="discarding the states an earlier run left in"):
        again = _run("fp32", MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path)), steps=1)
    assert again[0] == first[0]  # the same losses as in an empty folder
    small = MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "small"), host_budget_mb=0.1)
    with pytest.raises(PlanInfeasibleError, match=r"raise memory.host_budget_mb to at least 0.5126, or set"):
        _run("fp32", small, steps=1)  # the planner finds it
    with pytest.raises(PipelineError, match=r"raise memory.host_budget_mb to at least 0.5126, or set memory.weights"):
        _run("fp32", small, steps=1, planned=MemoryConfig())  # and the Pipeline, given a plan made for other settings
    with pytest.raises(ConfigError, match="memory.weights: expected host or auto unless optimizer is ssd"):
        config_from_dict({"memory": {"optimizer": "auto", "weights": "ssd", "ssd_dir": "x"}})
    with pytest.raises(ConfigError, match="memory.weights: expected host when optimizer is host"):
        config_from_dict({"memory": {"weights": "auto"}})
    with pytest.raises(
        PipelineError,
        match="stepped by plain AdamW with the factory's hyper-parameters, but the optimizer factory makes a SGD",
    ):
        Pipeline(
            [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)],
            torch.nn.functional.mse_loss,
            sample=(torch.randn(4, 2), torch.randn(4, 1)),
            num_microbatches=2,
            optimizer=partial(torch.optim.SGD, lr=0.1),
            memory=MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "other")),
        )


@pytest.mark.slow
def test_torchrun_entry_with_auto_states_equals_plain_pytorch(tmp_path, launch, reference):
    """auto under 0.2 MiB (fp32: 12 + 4 + 4 bytes per parameter in memory): neither rank's two stages fit
    (the plan's cut: rank 0 stages 0 and 2 of 6,600 and 14,448 parameters, rank 1 stages 1 and 3 of 7,224 and 6,192),
    so both move their optimizer states to SSD and then the weights of their largest stage (hand-computed in the
    terms of tests/partition/rules/test_placement.py)."""
    write_config, torchrun = launch
    cfg_path = write_config(
        tmp_path,
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 19},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": 3, "lr": 0.01, "precision": "fp32", "out_dir": str(tmp_path / "out")},
            "plan": {"num_gpus": 2, "num_stages": 4},
            "memory": {"optimizer": "auto", "weights": "auto", "ssd_dir": str(tmp_path / "ssd"), "host_budget_mb": 0.2},
        },
    )
    proc = torchrun(cfg_path, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stores = sorted(p.name for p in (tmp_path / "ssd").iterdir() if p.name != LOCK_FILE)  # the run held the folder
    assert stores == ["rank0", "rank1"]
    line = "optimizer states (auto): ssd for stages 0-3; weights (auto): host for stages 0, 3; ssd for stages 1-2"
    assert line in proc.stdout, proc.stdout[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # on disk: at least the fp32 master weights and both Adam moments of all 34,464 parameters
        assert m["ssd_bytes"] == sum(r["ssd_bytes"] for r in m["ranks"]) >= 3 * 4 * 34_464
    assert f"; ssd {fmt_bytes(metrics[-1]['ssd_bytes'])} in all" in proc.stdout
    losses = [m["loss"] for m in metrics]
    weights = {}
    for f in sorted((tmp_path / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    ref_losses, ref_weights = reference(load_config(cfg_path))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)


def test_auto_run_puts_the_largest_stage_on_ssd_and_stays_bit_identical(tmp_path):
    host_losses, host_weights, *_ = _run("bf16", None)
    # stages of 13,776, 7,224, 7,224 and 6,192 parameters, 16 bytes each in memory: 0.45 MiB holds the last two
    # and the weights, gradients and streaming shares of the first two (tests/partition/rules/test_placement.py's terms)
    memory = MemoryConfig(optimizer="auto", ssd_dir=str(tmp_path), host_budget_mb=0.45)
    losses, weights, placement, _ = _run("bf16", memory)
    assert losses == host_losses
    for k in host_weights:
        assert torch.equal(weights[k], host_weights[k]), k
    tiers = placement.optimizer
    assert tiers == {0: "ssd", 1: "ssd", 2: "host", 3: "host"}
    index = json.dumps(json.loads((tmp_path / "rank0" / "index.json").read_text()))
    for j, tier in tiers.items():
        assert (f"stage{j}" in index) == (tier == "ssd"), (j, tier)


def test_serialized_updates_give_the_same_bits(tmp_path):
    """overlap_updates=False (the updates after the backward, awaited in train_batch) only moves time."""
    host_losses, host_weights, *_ = _run("bf16", None)
    memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path), host_budget_mb=0.25)
    losses, weights, *_ = _run("bf16", memory, overlap=False)
    assert losses == host_losses
    for k in host_weights:
        assert torch.equal(weights[k], host_weights[k]), k


@pytest.mark.parametrize(
    ("budget_mb", "optimizer", "weights"),
    [
        (0.45, ["ssd", "ssd", "host", "host"], ["host"] * 4),  # the auto run above
        (0.3, ["ssd"] * 4, ["ssd", "ssd", "ssd", "host"]),  # then the weights of all but the smallest stage
    ],
)
def test_the_planner_predicts_the_pipelines_placement(tmp_path, budget_mb, optimizer, weights):
    """partition.rules.tiers places the states as the runtime does. The run has one rank, so the planner's gpu 0 is
    that rank and the server budget is not split. To compare the budgets: the runtime gives
    memory.host_budget_mb to the states alone, while the planner takes what the stages hold on the host tier
    between F and B out of a gpu's share first; so the planner gets host_budget_mb plus those bytes."""
    memory = MemoryConfig(optimizer="auto", weights="auto", ssd_dir=str(tmp_path), host_budget_mb=budget_mb)
    _, _, placement, plan = _run("bf16", memory, steps=1)
    assert list(placement.optimizer.values()) == optimizer and list(placement.weights.values()) == weights
    saved = sum(plan.num_microbatches * host_held_bytes(plan, j) for j in range(plan.num_stages))
    budget = int(budget_mb * MiB)  # as the Pipeline reads memory.host_budget_mb
    mem = place_tiers(plan, HostBudget(budget + saved, "the run's host_budget_mb + its saved inputs"))
    assert mem.gpus[0].saved_inputs_bytes == saved and mem.gpus[0].state_budget_bytes == budget
    assert mem.gpus[0].placement == placement  # the same tiers and the same streaming share
    assert [s.optimizer for s in mem.stages] == optimizer and [s.weights for s in mem.stages] == weights


def test_a_failed_disk_write_stops_the_run_with_the_io_error(tmp_path):
    """An I/O error while the weights and states stream from SSD (a load, an offload or an update) reaches the
    caller as the SwapIOError, closing the Pipeline does not hang, and the store records no stage as
    stepped past the others without marking it broken."""
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"precision": "bf16", "seed": 5},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )
    memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path), host_budget_mb=0.25)
    data = open_data(cfg.data, cfg.model.seq_len, 5, cfg.model.vocab_size)
    pipe = Pipeline(layer_factories(model_spec(cfg), 5), lm_loss, plan=plan_for_config(cfg), memory=memory)
    pipe.train_batch(*data.batch(0, 6))
    pipe.engine.wait_updates()
    assert pipe.store is not None
    pipe.store.engine.inject_fault(3, errno.EIO)  # the fourth piece of I/O from now fails
    with pytest.raises(SwapIOError, match="Input/output error|EIO|I/O error"):
        for s in range(1, 4):
            pipe.train_batch(*data.batch(s, 6))
        pipe.engine.wait_updates()
    pipe.close()  # does not hang on I/O left in flight
    meta = json.loads((tmp_path / "rank0" / "index.json").read_text())["meta"]
    # no stage is recorded as stepped past another unless its states are marked broken (open() refuses them)
    steps = {m["step"] for m in meta.values() if not m.get("broken")}
    assert len(steps) <= 1 and len(meta) == 4, meta
