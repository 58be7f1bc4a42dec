"""Peak host memory (RSS) of each rank of a training run with its states on SSD, against its host budget.

Trains a GPT of the given size under torchrun with memory.optimizer and memory.weights set to auto (or the
tiers given) and a per-rank host_budget_mb, then reads the largest peak RSS of any rank (the ranks are the
launcher's children: RUSAGE_CHILDREN's ru_maxrss, taken in a fresh process) and splits it into
  states    host_budget_mb: the states kept in memory and the SSD stages' streaming shares (a run that
            keeps everything in memory counts its 16 bytes per parameter, shared by the ranks, instead)
  arena     the plan's device arena, which on a CPU stand-in is host memory too (on a GPU it is not)
  device    the plan's whole stand-in device walk (partition.rules.device_peak, the largest rank): the arena and
            what the stage holds beside it (kept activations, messages), host memory too on a CPU stand-in
  overhead  the rest: the interpreter, torch, gloo and each stage's build-time copy.
With --baseline, the same run on a model of a few thousand parameters measures the overhead that does not
depend on the model. A check, not a timed benchmark: its figures go into BENCHMARKS.md.

  python scripts/check_rss.py --d-model 1024 --blocks 24 --budget-mb 512 --baseline   # 300M parameters
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from foundation.timing import Stopwatch
from mobiuspipe.config import config_from_dict
from mobiuspipe.startup.config_plan import model_spec, plan_for_config
from partition.rules.device_peak import planned_device_bytes
from partition.spec.models import layer_param_counts

MiB = 1 << 20
WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
    "sys.exit(code)\n"
)
"""Runs the launcher and prints the largest peak RSS of its descendants (KiB: Linux ru_maxrss)."""


def run_config(d_model: int, blocks: int, budget_mb: float, ssd_dir: str, args: argparse.Namespace) -> dict:
    return {
        "model": {"num_blocks": blocks, "d_model": d_model, "num_heads": max(1, d_model // 64), "seq_len": 32},
        "data": {"batch_size": 4, "num_microbatches": 2},
        "train": {"steps": args.steps, "lr": 1e-4, "precision": args.precision, "log_every": 1},
        "plan": {"num_gpus": args.ranks, "num_stages": args.stages, "device_memory_mb": args.device_mb},
        "memory": {
            "optimizer": args.optimizer,
            "weights": args.weights,
            "ssd_dir": ssd_dir,
            "host_budget_mb": budget_mb,
        },
    }


def measure(d_model: int, blocks: int, budget_mb: float, args: argparse.Namespace) -> dict:
    """Train once; the peak RSS of the largest rank and its split (bytes), and the run's wall time."""
    with tempfile.TemporaryDirectory(dir=args.ssd_root) as tmp:
        d = run_config(d_model, blocks, budget_mb, str(Path(tmp) / "ssd"), args)
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(d))
        cfg = config_from_dict(d, str(path))
        plan = plan_for_config(cfg)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]
        cmd = [sys.executable, "-c", WRAPPER, *torchrun, "-m", "mobiuspipe.train", "--config", str(path)]
        with Stopwatch() as sw:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode != 0:
            raise SystemExit(f"the run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        peak = int(out.stdout.split("MAXRSS_KIB")[-1].split()[0]) * 1024
        banner = next((line for line in out.stdout.splitlines() if "optimizer states (" in line), "")
    params = sum(layer_param_counts(model_spec(cfg)))
    device = max(planned_device_bytes(plan, standin=True))
    in_memory = int(budget_mb * MiB) if "ssd" in banner else 16 * params // args.ranks  # all in memory: their size
    return {
        "params": params,
        "fp32_state_bytes": 16 * params,
        "peak_rss_bytes": peak,
        "budget_bytes": int(budget_mb * MiB),
        "in_memory_bytes": in_memory,
        "arena_bytes": plan.arena_bytes,
        "device_bytes": device,
        "overhead_bytes": peak - in_memory - device,
        "wall_s": sw.s,
        "placement": banner.split("; optimizer states")[-1].strip(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--budget-mb", type=float, default=512.0, help="host_budget_mb per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stages", type=int, default=16)
    p.add_argument("--device-mb", type=float, default=512.0, help="each CPU stand-in's memory (the arena)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--optimizer", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--ssd-root", default=None, help="folder for the SSD stores (default: the temp folder)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--baseline", action="store_true", help="also measure a tiny model's overhead")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {"run": measure(args.d_model, args.blocks, args.budget_mb, args)}
    if args.baseline:
        result["baseline"] = measure(32, 2, args.budget_mb, argparse.Namespace(**{**vars(args), "stages": args.ranks}))
    if args.json:
        print(json.dumps(result))
        return
    for name, r in result.items():
        print(
            f"{name}: {r['params'] / 1e6:.1f}M parameters ({r['fp32_state_bytes'] / MiB:.0f} MiB of fp32 states, "
            f"{r['fp32_state_bytes'] / args.ranks / r['budget_bytes']:.1f}x the per-rank budget); peak RSS of the "
            f"largest rank {r['peak_rss_bytes'] / MiB:.0f} MiB = states {r['in_memory_bytes'] / MiB:.0f} + stand-in "
            f"device {r['device_bytes'] / MiB:.0f} (arena {r['arena_bytes'] / MiB:.0f}) + overhead "
            f"{r['overhead_bytes'] / MiB:.0f} MiB; {r['wall_s']:.0f} s; "
            f"{r['placement']}"
        )


if __name__ == "__main__":
    main()
