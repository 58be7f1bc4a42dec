"""The planner's choice on CPU stand-ins against the plans it passed over: the tiny GPT of scripts/run.sh
(examples/tiny-gpt.yaml) trained by `mobiuspipe train` (2 ranks) at several stage and microbatch counts, each run's
median step against the planner's prediction for the same counts, and the fixed per-call costs the traces imply.

Rows: `auto` (plan.num_stages and data.num_microbatches auto: what a run without them gets) and each fixed
(stages, microbatches) of --plans. Each run trains --steps steps; its step is the median of metrics.jsonl's step_s from
step 4 on. Runs alternate row by row for --rounds rounds, so that the machine's drift touches them alike.

What the traces imply (runtime.trace_steps of every run): a layer's forward at microbatch size 1 and 2, from the F
actions of two runs with the same stage count, fit to  t(b) = c + b x  per layer call; c is the fixed cost of one
layer call (Python dispatch, hooks, views) that FLOPs do not predict (partition.spec.hardware's forward_call_s).

  .venv/bin/python scripts/bench_standin_plans.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from benchlib import markdown_table

from mobiuspipe.profiling.refine import loop_seconds, recv_seconds, send_seconds
from mobiuspipe.runtime.action_trace import read_chrome
from partition.plan import load_plan

ROOT = Path(__file__).resolve().parent.parent
PLANS = ((4, 4), (4, 8), (8, 8), (6, 4), (8, 4), (3, 2), (4, 2))


def _config(base: dict, out: Path, plan: tuple[int, int] | None, steps: int) -> Path:
    """The tiny GPT's config with the stage and microbatch counts fixed (None: auto), traced, into out."""
    cfg = json.loads(json.dumps(base))
    cfg["plan"]["num_stages"] = "auto" if plan is None else plan[0]
    cfg["data"]["num_microbatches"] = "auto" if plan is None else plan[1]
    cfg["train"].update(steps=steps, out_dir=str(out), tensorboard=False)
    cfg["runtime"]["trace_steps"] = [steps - 3, steps - 2]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path) -> tuple[float, dict]:
    """(the median step seconds from step 4 on, the plan the run used)."""
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(config)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    out = config.parent
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in rows if r.get("kind") == "train" and r["step"] >= 4]
    return statistics.median(steps), yaml.safe_load((out / "plan.yaml").read_text())


def _per_layer_s(out: Path, plan: dict, kind: str) -> float:
    """The mean seconds per layer of the run's traced `kind` actions (F: a forward; B: a recompute and a backward),
    over every stage but the last (whose forward runs inside its backward)."""
    events = json.loads((out / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    stages = plan["stages"]
    per_layer = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != kind:
            continue
        j = int(e["name"][1:].split(".")[0])  # F{stage}.{microbatch}, B{stage}.{microbatch}
        if j == len(stages) - 1:
            continue
        layers = stages[j]["last"] - stages[j]["first"] + 1
        per_layer.append(e["dur"] * 1e-6 / layers)
    return statistics.mean(per_layer)


def _message_s(out: Path, steps: int) -> tuple[float, float, float]:
    """(send_s, recv_s, step_overhead_s) of the run's trace, as `mobiuspipe profile --refine` measures them."""
    per_rank, plan, traced = read_chrome(out / "trace.json"), load_plan(out / "plan.yaml"), [steps - 3, steps - 2]
    return (
        send_seconds(per_rank, traced, plan) or 0.0,
        recv_seconds(per_rank, traced, plan) or 0.0,
        loop_seconds(per_rank, traced[:1]) or 0.0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    base = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    rows: dict[str, list[float]] = {}
    plans: dict[str, dict] = {}
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    messages: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for plan in (None, *PLANS):
                name = "auto" if plan is None else f"{plan[0]} stages x {plan[1]} microbatches"
                out = Path(tmp) / f"{r}-{name.replace(' ', '_')}"
                step, used = _train(_config(base, out, plan, args.steps))
                rows.setdefault(name, []).append(step)
                plans[name] = used
                forward.setdefault(name, []).append(_per_layer_s(out, used, "F"))
                backward.setdefault(name, []).append(_per_layer_s(out, used, "B"))
                messages.setdefault(name, []).append(_message_s(out, args.steps))
                print(f"round {r}: {name}: {step * 1e3:.1f} ms", flush=True)
    best = min(statistics.median(v) for v in rows.values())
    table = []
    for name, v in rows.items():
        used = plans[name]
        m = used["num_microbatches"]
        table.append(
            [
                name,
                f"{len(used['stages'])} x {m} of {8 // m}",
                f"{used['predicted_step_time_s'] * 1e3:.1f}",
                " ".join(f"{t * 1e3:.1f}" for t in v),
                f"{statistics.median(v) / best:.2f}x",
                f"{statistics.median(forward[name]) * 1e6:.0f}",
                f"{statistics.median(backward[name]) * 1e6:.0f}",
            ]
        )
    print(
        markdown_table(
            [
                "row",
                "plan (stages x microbatches of size)",
                "predicted ms",
                "measured ms",
                "vs best",
                "F us/layer",
                "B us/layer",
            ],
            table,
        )
    )
    for name, v in messages.items():
        send, recv, loop = (statistics.median(x[i] for x in v) * 1e6 for i in range(3))
        print(f"{name}: a message costs its sender {send:.0f} us, its receiver {recv:.0f} us; the loop {loop:.0f} us")
    for kind, times in (("forward", forward), ("recompute and backward", backward)):
        one, two = (statistics.median(times[f"4 stages x {m} microbatches"]) for m in (8, 4))
        print(
            f"a layer's {kind}: {one * 1e6:.0f} us at microbatch 1, {two * 1e6:.0f} us at 2: fixed cost per call "
            f"{(2 * one - two) * 1e6:.0f} us, {(two - one) * 1e6:.0f} us per sequence"
        )


if __name__ == "__main__":
    main()
