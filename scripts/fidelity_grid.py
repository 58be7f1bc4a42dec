"""The grid scripts/bench_fidelity.py measures: its models (built-in GPTs and HF llamas), plans (ranks x stages)
and activation policies, and how one cell's run config and measured profile are made."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

from bench_pipeline import SIZES
from benchlib import torch_threads

from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.profiling.profiler import measure_profile
from mobiuspipe.runtime.activations import stage_modes
from mobiuspipe.startup.config_plan import model_spec
from mobiuspipe.startup.swaps import plan_as_run, swap_tiers
from partition.plan import Plan
from partition.rules.tiers import HostBudget
from partition.search import predict_step
from partition.sim.types import SimResult
from partition.spec.profile import Profile
from topology import Topology

GPT_MODELS = {
    **SIZES,
    "odd": {
        "model": {"num_blocks": 7, "d_model": 120, "num_heads": 5, "seq_len": 97},
        "data": {"batch_size": 6, "num_microbatches": 3},
    },
    "odd-wide": {
        "model": {"num_blocks": 7, "d_model": 360, "num_heads": 5, "seq_len": 97},
        "data": {"batch_size": 6, "num_microbatches": 3},
    },
}
"""Built-in GPT configs: bench_pipeline's tiny and small, one of odd sizes and the same 3x wider (its actions take
milliseconds to tens of milliseconds, where tiny's and odd's take tenths of one to a few)."""

LLAMA = {
    "hidden_size": 96,
    "intermediate_size": 259,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
"""The HF llama (tests/mobiuspipe/hf_fixtures.py's config, wider and deeper): sequences of LLAMA_RUN's seq_len."""
HF_MODELS = {"llama": LLAMA, "llama-wide": {**LLAMA, "hidden_size": 288, "intermediate_size": 777}}
"""HF llamas by name: LLAMA and the same 3x wider."""
LLAMA_RUN = {"model": {"seq_len": 61}, "data": {"batch_size": 8, "num_microbatches": 4}}

PLANS = {"1x4": (1, 4), "1x6": (1, 6), "2x4": (2, 4), "2x6": (2, 6)}
"""Plan name -> (ranks, stages); two ranks use the cross mapping."""
PARTNER = {"1x4": "1x6", "1x6": "1x4", "2x4": "2x6", "2x6": "2x4"}
"""With --calibrate, the plan whose traced run refines the profile a plan's calibrated prediction uses: the same
ranks, another cut."""

DEVICE_MB = 4096
"""Each CPU stand-in's memory budget: large enough that no plan here is memory bound."""


@dataclass(frozen=True)
class Policy:
    """An activation policy as the benchmark drives it: memory.activations and memory.activation_tier of the
    run; the prediction simulates the plan as the run runs it (mobiuspipe.startup.swaps.plan_as_run)."""

    activations: str
    tier: str

    @property
    def run_keys(self) -> dict:
        return {"memory": {"activations": self.activations, "activation_tier": self.tier}}

    def as_run(self, plan: Plan, ssd_dir: str) -> Plan:
        """The plan as a run under this policy runs it."""
        modes = stage_modes(self.activations, plan)
        tiers = swap_tiers(plan, MemoryConfig(activation_tier=self.tier, ssd_dir=ssd_dir), modes)  # ssd: needs one
        return plan_as_run(plan, modes, tiers)


def simulated(run: Plan, topo: Topology) -> SimResult:
    """The simulator's step of a plan as run (Policy.as_run)."""
    return predict_step(run, topo, HostBudget(None, "unlimited")).sim


POLICIES = {
    "plan": Policy("plan", "plan"),
    "recompute": Policy("recompute", "device"),
    "keep": Policy("keep", "device"),
    "recompute-host": Policy("recompute", "host"),
    "keep-host": Policy("keep", "host"),
    "keep-ssd": Policy("keep", "ssd"),
}
"""Policies measured: the plan's choice (every stage keeps on these roomy stand-ins), recompute and keep forced,
and each with its held bytes swapped to the host or the SSD (the run's ssd_dir is in its folder)."""


def model_dicts(tmp: Path, names: list[str]) -> dict[str, dict]:
    """Run-config parts (model, data) of each model; the llamas are saved to tmp first (random weights)."""
    out: dict[str, dict] = {n: copy.deepcopy(GPT_MODELS[n]) for n in names if n in GPT_MODELS}
    hf = [n for n in names if n in HF_MODELS]
    if not hf:
        return out  # transformers is not imported
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "mobiuspipe"))
    from hf_fixtures import save_model  # pyright: ignore[reportMissingImports]

    for name in hf:
        save_model("llama", tmp / name, seed=0, **HF_MODELS[name])
        out[name] = {"model": {"hf": str(tmp / name), **LLAMA_RUN["model"]}, "data": dict(LLAMA_RUN["data"])}
    return out


def run_dict(parts: dict, ranks: int, stages: int, steps: int, out_dir: str, plan_file: str, policy: Policy) -> dict:
    """The YAML-able config of one run: 1 thread per rank, fp32, the plan file, the policy's keys."""
    d = copy.deepcopy(parts)
    d["train"] = {"steps": steps, "out_dir": out_dir, "log_every": steps, "precision": "fp32"}
    d["plan"] = {"file": plan_file}
    d["runtime"] = {"threads": 1}
    for section, keys in policy.run_keys.items():
        d.setdefault(section, {}).update(keys)
    return d


def layers_of(cfg) -> list:
    """The model's layers, built as the runtime builds them."""
    if cfg.model.hf:
        from mobiuspipe.models.hf import layer_factories as hf_layer_factories
        from mobiuspipe.models.hf import open_hf

        return [f() for f in hf_layer_factories(open_hf(cfg.model.hf, cfg.model.seq_len))]
    return [f() for f in layer_factories(model_spec(cfg), cfg.train.seed)]


def measure(parts: dict) -> Profile:
    """The model's measured profile on one microbatch of its first batch, 1 thread (as each rank runs)."""
    cfg = config_from_dict({**parts, "plan": {"num_gpus": 1, "num_stages": 4}})
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    x, y = data.batch(0, cfg.data.batch_size)
    m = cfg.data.num_microbatches
    assert m is not None, "the grid's configs fix data.num_microbatches"
    xm, ym = x[: x.shape[0] // m], y[: y.shape[0] // m]
    with torch_threads(1):
        return measure_profile(
            layers_of(cfg),
            xm,
            device="cpu",
            name=model_spec(cfg).name,
            device_name="cpu-standin",
            dtype_name="fp32",
            microbatch_size=xm.shape[0],
            seq_len=xm.shape[1],
            loss_fn=lambda out: lm_loss(out.float(), ym),
            microbatches=m,
        )
