"""Where the compute thread of bench_tiers' step waits, with every state in host memory and every state on SSD: the
seconds a step spends in the Stage calls that can block (taking the gradient slot, waiting for a stage's update or
its loads, the step's last updates), and the process's CPU seconds a step against its wall time.

The same GPT and plan as scripts/bench_tiers.py (one rank, CPU stand-in, fp32), 2 untimed steps then 4 timed; each
step waits for its updates, as bench_tiers' rows do (wait_update's seconds include that last wait, which is also
printed alone). The Stage methods are wrapped to time them (instrumentation only: the same calls run).

  PYTHONPATH=. .venv/bin/python scripts/bench_tier_waits.py --ssd-dir /path/on/nvme
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from functools import partial

import torch
from bench_tiers import _config

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.stage import Stage
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

TIMED = ("begin_backward", "zero_grads", "wait_update", "wait_loaded")
"""The Stage calls the compute thread can block in: the gradient slot's last users, a stage's update, its loads."""
STEPS, WARM = 4, 2


def _wrap(spent: dict[str, float]) -> None:
    """Time every call of TIMED into spent (seconds, by name)."""
    for name in TIMED:
        fn = getattr(Stage, name)

        def timed(self, *a, _fn=fn, _name=name, **k):
            start = time.perf_counter()
            try:
                return _fn(self, *a, **k)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(Stage, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--ssd-dir", default=None, help="a folder on the disk to measure (default: a temp folder)")
    p.add_argument("--budget-mb", type=float, default=160.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    shape = argparse.Namespace(blocks=8, d_model=512, stages=6, device_mb=512.0)
    cfg = config_from_dict(_config(shape, "fp32"))
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    spent: dict[str, float] = collections.defaultdict(float)
    _wrap(spent)
    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as tmp:
        ssd = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=f"{tmp}/a", host_budget_mb=args.budget_mb)
        for name, memory in (("host", None), ("ssd", ssd)):
            layers = layer_factories(model_spec(cfg), 1)
            pipe = Pipeline(
                layers, lm_loss, plan=plan_for_config(cfg), optimizer=partial(CPUAdam, lr=1e-4), memory=memory
            )
            try:
                for s in range(WARM + STEPS):
                    if s == WARM:
                        spent.clear()
                        wall, cpu = time.perf_counter(), sum(os.times()[:4])
                    x, y = data.batch(s, 4)
                    pipe.train_batch(x, y)
                    start = time.perf_counter()
                    pipe.engine.wait_updates()
                    spent["the step's last updates"] += time.perf_counter() - start
                wall, cpu = (time.perf_counter() - wall) / STEPS, (sum(os.times()[:4]) - cpu) / STEPS
            finally:
                pipe.close()
            waits = ", ".join(f"{k} {v / STEPS:.3f}" for k, v in spent.items())
            print(
                f"{name}: step {wall:.3f} s, process CPU {cpu:.3f} s a step; compute thread waits (s a step): {waits}"
            )


if __name__ == "__main__":
    main()
