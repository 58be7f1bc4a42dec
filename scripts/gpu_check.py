"""Prove the CUDA paths in one run (scripts/gpu_check.sh): equivalence, overlap, memory, speed, the machine, two ranks.

On a GPU: a mid-size GPT (d_model 1024, seq 512, 10 layers in 8 stages, 4 microbatches) in fp32 and bf16 under
every activation policy x tier the one gpu runs (device, host, SSD), with SSD weights, 2 accumulation passes and
fp16 with a skipped step, each against plain PyTorch on the same GPU and bit for bit against the others; with
clipping, updates speculated and rolled back against waiting ones, and the delayed update (in memory and on the SSD)
against plain PyTorch running its rule (a smaller GPT on a GPU: d_model 256, seq 128); LoRA over
an int8 and an NF4 base (a small GPT) against plain PyTorch on the same quantized layers; the
overlap of loads with compute, the measured peak against the plan, the step against its floor, the machine as
NVML and sysfs show it, and with 2 or more GPUs a torchrun job on [0,1,0,1] with the peer tier staged through the
host. On a CPU-only machine: the same checks on the strict stand-ins (MOBIUSPIPE_STRICT=1) at a small size, so
CI keeps the script working; the speed and overlap bars apply on a GPU only.

Prints a table (check, result, figure, bar) and writes gpu_check.json; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MOBIUSPIPE_STRICT", "1")  # the stand-ins as strict as CUDA where there is no GPU

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_runs as runs
from benchlib import stopped_rank_run, torchrun_metrics
from gpu_check_memory import hf_counts, memory_rows
from gpu_context import contexts
from gpu_table import Table, tally
from gpu_tests import gpu_tests

from mobiuspipe import _ext
from mobiuspipe.config import MemoryConfig
from mobiuspipe.optim.loss_scale import LossScaler
from topology import cpu_standin

ROOT = Path(__file__).resolve().parent.parent
BARS = {"hidden": 0.90, "speed": 1.15}
"""The issue's bars on a GPU: share of load time hidden under compute; step time over its floor."""
CLIP = 0.05
"""The updates check's max_grad_norm: below the GPT's first gradient norm, so its first step clips."""
SPEED_STEPS, SKIP = 6, 2
"""The speed check's steps, and how many first steps it leaves out (warm-up, the first host updates' states)."""


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> float:
    """The largest |a - b| / (atol + rtol |b|) over every weight: at most 1 where a is b within torch.testing's
    rule (a and b: the same keys)."""
    return max(float(((a[k] - b[k]).abs() / (atol + rtol * b[k].abs())).max()) for k in b)


def equivalence(t: Table, size: runs.Size, device: torch.device, topology, ssd: Path, steps: int) -> dict:
    """(a): every policy x tier equals the recompute-on-device run bit for bit, and that run equals plain PyTorch.
    Each row runs guarded: one that raises is a failed row and the others still run. Returns each precision's
    (recompute-on-device run, plan): the memory check holds that run to that plan."""
    out = {}
    for precision in ("fp32", "bf16"):
        plan = runs.make_plan_for(size, precision, device, topology)
        base = runs.pipeline_run(size, plan, precision, steps)
        plain = runs.plain_run(size, precision, steps, device)
        t.add(f"{precision} pipeline vs plain PyTorch", *against(base, plain, precision))
        for policy in ("recompute", "keep"):
            for tier in ("device", "host", "ssd"):
                if (policy, tier) == ("recompute", "device"):
                    continue
                memory = MemoryConfig(activation_tier=tier, ssd_dir=str(ssd / f"{precision}-{policy}-{tier}"))
                check = f"{precision} {policy} on {tier}"
                t.guarded(check, same_as, t, check, base, size, plan, precision, steps, policy, memory, "= recompute")
        memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(ssd / f"{precision}-weights"))
        check = f"{precision} weights and states on SSD"
        t.guarded(check, same_as, t, check, base, size, plan, precision, steps, "recompute", memory, "= host")
        out[precision] = (base, plan)
    t.guarded("fp32 accumulation 2 vs plain PyTorch", accumulated, t, size, device, topology, steps)
    t.guarded("fp16 skipped step leaves the weights", fp16_skip, t, size, device, topology, steps)
    return out


def same_as(
    t: Table, check: str, base: runs.Run, size: runs.Size, plan, precision: str, steps: int, policy, memory, bar: str
) -> None:
    """A row: the run under `policy` and `memory` equals `base` bit for bit."""
    got = runs.pipeline_run(size, plan, precision, steps, activations=policy, memory=memory)
    same = got.losses == base.losses and equal(got.weights, base.weights)
    t.add(check, same, "bit-identical" if same else "differs", bar)


def against(got: runs.Run, plain: runs.Run, precision: str) -> tuple[bool, str, str]:
    """(ok, figure, bar) of a pipeline run against the plain recipe (runs.plain_run), which does the same
    arithmetic: equal bit for bit, or the size of the difference."""
    if got.losses == plain.losses and equal(got.weights, plain.weights):
        return True, "bit-identical", "= the recipe"
    if precision == "fp32":
        return (
            False,
            f"differs: worst weight {worst(got.weights, plain.weights, 1e-5, 1e-6):.3g}x tolerance",
            "bit for bit",
        )
    w = worst(got.weights, plain.weights, 1e-2, 1e-3)
    loss = max(abs(a - b) / abs(b) for a, b in zip(got.losses, plain.losses))
    return w <= 1 and loss <= 1e-3, f"worst weight {w:.2f}x tolerance, losses within {loss:.1e}", "rtol 1e-2, atol 1e-3"


def accumulated(t: Table, size: runs.Size, device: torch.device, topology, steps: int) -> None:
    plan = runs.make_plan_for(size, "fp32", device, topology)
    got = runs.pipeline_run(size, plan, "fp32", steps, accumulation=2)
    plain = runs.plain_run(size, "fp32", steps, device, accumulation=2)
    t.add("fp32 accumulation 2 vs plain PyTorch", *against(got, plain, "fp32"))


def fp16_skip(t: Table, size: runs.Size, device: torch.device, topology, steps: int) -> None:
    """A loss scale of 2^30 overflows fp16's gradients at once: the first step is skipped (no weight moves) and the
    scale backs off to 2^14, where the steps go through."""
    plan = runs.make_plan_for(size, "fp16", device, topology)

    def scaler() -> LossScaler:
        return LossScaler(scale=2.0**30, backoff_factor=2.0**-16)

    start = runs.pipeline_run(size, plan, "fp16", 1, scaler=scaler())
    got = runs.pipeline_run(size, plan, "fp16", steps + 1, scaler=scaler())
    ok = got.skipped[0] and not got.skipped[-1] and all(map(torch.isfinite, map(torch.tensor, got.losses)))
    ok = ok and equal(start.weights, runs.pipeline_run(size, plan, "fp16", 0).weights)
    t.add("fp16 skipped step leaves the weights", bool(ok), f"skipped {got.skipped}", "first skipped, last not")


def updates(t: Table, size: runs.Size, device: torch.device, topology, ssd: Path, steps: int) -> None:
    """The updates that leave the critical path, each against the waiting one and plain PyTorch: with clipping,
    updates speculated and rolled back (the first step clips); the delayed update (from step 1), with the weights
    and states in memory and on the SSD."""
    plans = {p: runs.make_plan_for(size, p, device, topology) for p in ("fp32", "bf16")}
    plan = plans["fp32"]
    got = runs.pipeline_run(size, plan, "fp32", steps, clip=CLIP)
    waited = runs.pipeline_run(size, plan, "fp32", steps, clip=CLIP, speculative=False)
    same = got.losses == waited.losses and equal(got.weights, waited.weights)
    rolled = sum(got.rolled_back)
    t.add(
        "fp32 clipped: speculated updates = waiting ones",
        same and rolled > 0,
        f"{'bit-identical' if same else 'differs'}, {rolled} rolled back",
        "bit for bit, some rolled back",
    )
    plain = runs.plain_run(size, "fp32", steps, device, clip=CLIP)
    t.add("fp32 clipped vs plain PyTorch", *against(got, plain, "fp32"))
    for precision, plan in plans.items():
        got = runs.pipeline_run(size, plan, precision, steps, delayed=1)
        plain = runs.plain_run(size, precision, steps, device, delayed=1)
        t.add(f"{precision} delayed update vs plain PyTorch", *against(got, plain, precision))
        memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(ssd / f"{precision}-delayed"))
        on_ssd = runs.pipeline_run(size, plan, precision, steps, delayed=1, memory=memory)
        same = on_ssd.losses == got.losses and equal(on_ssd.weights, got.weights)
        t.add(f"{precision} delayed update, on SSD", same, "bit-identical" if same else "differs", "= in memory")


def memory_and_speed(
    t: Table, base: runs.Run, size: runs.Size, device: torch.device, plan, cuda: bool, args: argparse.Namespace
) -> dict:
    """(c) memory against the plan (gpu_check_memory), (b) overlap, (d) the step against its floor."""
    memory_rows(t, base, size, device, plan, cuda, args.out, args.memory_report)
    gbps = runs.h2d_gbps(device, 256 << 20 if cuda else 32 << 20)
    # Steps in steady state: a step ends the previous step's host updates, so the second absorbs the first's
    # allocation of the optimizer states; both sides skip their first SKIP steps.
    piped = runs.pipeline_run(size, plan, "fp32", SPEED_STEPS)
    plain = runs.plain_run(size, "fp32", SPEED_STEPS, device)
    floor = max(runs.steady(plain.step_s, SKIP), piped.loaded_bytes / (gbps * 1e9))
    step = runs.steady(piped.step_s, SKIP)
    t.add(
        "step over its floor",
        step / floor <= BARS["speed"] if cuda else None,
        f"{step * 1e3:.1f} ms / {floor * 1e3:.1f} ms = {step / floor:.2f}x ({gbps:.1f} GB/s)",
        f"<= {BARS['speed']}x on a GPU",
    )
    if cuda:
        o = runs.overlap_on_gpu(size, plan, "fp32", trace=args.trace)
        t.add(
            "load time hidden under compute",
            o["hidden"] >= BARS["hidden"],
            f"{o['hidden']:.0%} of {o['copy_us'] / 1e3:.1f} ms of copies (under kernels {o['under_kernels']:.0%})",
            f">= {BARS['hidden']:.0%}",
        )
        t.add(
            "host-blocking syncs per stage visit",
            o["syncs_per_visit"] <= 1,
            f"{o['syncs_per_visit']:.2f} ({o['syncs_per_step']:.0f} a step; helpers {o['helper_syncs_per_step']:.0f})",
            "<= 1",
        )
    else:
        waited = base.load_wait_s / max(1, len(base.step_s) - 1)
        t.add(
            "loads waited for, per step",
            None,
            f"{waited * 1e3:.1f} ms (the stand-in's copy thread; the bar is a GPU's)",
        )
    return {"step_s": step, "floor_s": floor, "h2d_gbps": gbps}


def machine(t: Table, cuda: bool) -> dict:
    """(e): the machine as NVML and sysfs show it."""
    from topology import TopologyError
    from topology.discover import discover

    try:
        topo = discover()
    except TopologyError as e:
        t.add("machine discovered", False if cuda else None, str(e).split(":")[0])
        return {"gpus": [], "error": str(e)}
    text = "; ".join(f"gpu {g.index} {g.name} {g.memory_bytes / 2**30:.0f} GiB" for g in topo.gpus) or "no gpu"
    t.add("machine discovered", bool(topo.gpus) if cuda else None, text)
    return {"gpus": [g.name for g in topo.gpus], "source": topo.source}


def quantized_lora(t: Table, device: torch.device, steps: int) -> None:
    """LoRA over an int8 and an NF4 base (torchao's, dequantized in the stage's weight slot on this device), the
    adapters' states on the host and (NF4) on the gpu: the Pipeline trains as plain PyTorch on the same quantized
    layers does, on the same device, fp32."""
    try:
        import torchao  # noqa: F401 - a GPU image may lack it (the device README says how to carry its wheel)
    except Exception as e:  # noqa: BLE001 -- missing, or built for another torch: the machine's, not the check's
        t.add("LoRA over a quantized base", None, f"skipped: torchao does not import: {type(e).__name__}: {e}"[:90])
        return
    for base_dtype, optimizer in (("int8", "host"), ("nf4", "host"), ("nf4", "device")):
        got, want = runs.lora_runs(base_dtype, steps, device, optimizer)
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        where = ", states on the gpu" if optimizer == "device" else ""
        t.add(f"LoRA, {base_dtype} base{where}, vs plain PyTorch", rel <= 1e-5, f"losses within {rel:.1e}", "<= 1e-5")


def two_ranks(t: Table, folder: Path, gpus: int, cuda: bool) -> None:
    """(f): torchrun on [0,1,0,1] with the peer tier staged through the host (P2P off), against one rank, both with
    deterministic kernels. On a GPU the model is a GPT-2 with tied embeddings (the tied gradient crosses the
    ranks) whose messages are 16 MiB, more than NCCL's buffers hold, so a send waits for its receive."""
    if gpus == 1:
        t.add("two ranks", None, "one GPU here: skipped")
        return
    os.environ.update({"NCCL_P2P_DISABLE": "1", "MOBIUSPIPE_PEER_STAGED": "1"})  # the ranks inherit them
    model, data, what = (
        _two_rank_model(folder) if cuda else ({"num_blocks": 2, "d_model": 64, "num_heads": 4, "seq_len": 64}, {}, "")
    )
    losses = {}
    for nproc, memory in ((1, {}), (2, {"activations": "recompute", "activation_tier": "peer"})):
        run = folder / f"ranks{nproc}"
        run.mkdir()
        d = {
            "model": model,
            "data": {**data, "batch_size": 8, "num_microbatches": 4},
            "train": {"steps": 3, "seed": 2, "precision": "fp32", "out_dir": str(run / "out")},
            "plan": {"num_gpus": nproc, "num_stages": 4, "mapping": "round-robin"},
            "memory": memory,
            "runtime": {"comm_timeout_s": 60, "deterministic": True, "threads": 1},  # one order of each sum
        }
        try:
            losses[nproc] = [r["loss"] for r in torchrun_metrics(d, nproc, run, timeout=t.left(300))]
        except RuntimeError as e:  # the run's own error: a failed row, the other checks still run
            t.add(f"torchrun {nproc} rank(s)", False, _cause(str(e))[:100])
            print(str(e), flush=True)
            return
    same = losses[1] == losses[2]
    t.add(
        f"2 ranks [0,1,0,1], peer tier, P2P off{what}",
        same,
        "losses equal one rank's" if same else f"{losses}",
        "= one rank",
    )
    stopped_rank(t, folder, cuda)


def stopped_rank(t: Table, folder: Path, cuda: bool) -> None:
    """A rank stopped mid-run (alive, silent): the other stops within comm_timeout_s, naming it. On NCCL its host
    waits at a synchronization, which only the watch's abort of the communicators ends."""
    timeout_s = 10.0 if cuda else 3.0
    run = folder / "stopped"
    run.mkdir()
    d = {
        "model": {"num_blocks": 2, "d_model": 64, "num_heads": 4, "seq_len": 64},
        "data": {"batch_size": 8, "num_microbatches": 4},
        "train": {"steps": 100000, "out_dir": str(run / "out")},
        "plan": {"num_gpus": 2, "num_stages": 4},
        "runtime": {"comm_timeout_s": timeout_s, "threads": 1},
    }
    code, waited, said = stopped_rank_run(d, run, timeout=timeout_s + 60)
    ok = code == 2 and "rank 1 has given no sign of life" in said and waited < timeout_s + 20
    said = said.removeprefix("mobiuspipe.train: error: ")[:80]
    t.add("a stopped rank is named", ok, f"after {waited:.0f} s: {said}", f"< {timeout_s + 20:g} s")


def _cause(text: str) -> str:
    """The line of a failed run's output that says why: a mobiuspipe error or an exception, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("mobiuspipe") and "error" in line or "Error:" in line]
    return (said or lines or ["no output"])[-1]


def _two_rank_model(folder: Path, width: int = 1024, seq: int = 2048) -> tuple[dict, dict, str]:
    """A random GPT-2 (tied embeddings, d_model width, 2 blocks) saved for seq tokens, and token ids for 3 steps:
    each activation between stages is 2 rows x seq x width fp32 (16 MiB by default)."""
    import numpy as np
    from transformers import AutoModelForCausalLM, GPT2Config

    vocab = 301
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=width,
        n_layer=2,
        n_head=max(1, width // 64),
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = folder / "gpt2-tied"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(hf))
    tokens = folder / "tokens.bin"
    np.random.default_rng(4).integers(0, vocab, 3 * 8 * seq + 1).astype(np.uint16).tofile(tokens)
    mib = 2 * seq * width * 4 / 2**20
    return (
        {"hf": str(hf), "seq_len": seq},
        {"tokens": str(tokens), "shuffle": False},
        f", tied GPT-2, {mib:g} MiB messages",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument(
        "--out",
        default="gpu_check.json",
        help="where the results go (JSON); on a GPU the fp32 plan the memory check holds the run to goes beside it, "
        "as plan_fp32.yaml",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--time-limit",
        type=float,
        default=450.0,
        metavar="S",
        help="seconds the checks may take (450: within gpu_check.sh's 480): each subprocess and wait is held to what "
        "is left, and a section with under 20 s left is skipped with a row saying so",
    )
    p.add_argument("--trace", help="on a GPU: write the overlap check's profiler trace here (Chrome JSON)")
    p.add_argument(
        "--memory-report",
        help="on a GPU: record the allocator's history over 3 fp32 steps and write here what was live at the peak, "
        "by the place in the code that allocated it (text)",
    )
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if (why := unusable_gpu(nvidia_driver(), cuda)) is not None:
        Table(Path(args.out), {"device": "unusable", "torch": torch.__version__}).add(
            "CUDA usable by this torch", False, why, "a GPU here runs the checks"
        )
        return 1
    torch.set_num_threads(1)  # one order of every CPU reduction on both sides of each comparison
    # Bit-for-bit comparisons need kernels that give the same bits on every run: fp32 attention's backward
    # (SDPA's memory-efficient kernel) adds with atomics otherwise, and plain PyTorch then differs from itself.
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    size = runs.GPU_SIZE if cuda else runs.CPU_SIZE
    name = torch.cuda.get_device_name(0) if cuda else "cpu-standin"
    print(f"gpu_check on {name if cuda else 'CPU stand-ins (strict)'}: {size}", flush=True)
    adam = "C++ extension" if _ext.HAVE_C else f"PyTorch fallback ({_ext.WHY_NOT[:80]})"
    print(f"host Adam: {adam}", flush=True)
    head = {"device": name, "torch": torch.__version__, "size": str(size), "host_adam": adam}
    t = Table(Path(args.out), head, args.time_limit)
    topology = runs.gpu_topology() if cuda else cpu_standin(1, 256 << 20)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        base = t.guarded("equivalence", equivalence, t, size, device, topology, Path(tmp), args.steps)
        if base is not None:
            run, plan = base["fp32"]  # the plan the run was made from: one profile, so one X per stage, one W
            t.figures = t.guarded("memory and speed", memory_and_speed, t, run, size, device, plan, cuda, args) or {}
        # the short sections before the longer newer ones: a run cut by its time limit keeps the rows it saved
        t.machine = t.guarded("machine", machine, t, cuda) or {}
        t.guarded("gpu-marked tests", gpu_tests, t.add, t.left(300), cuda, Path(args.out).with_name("gpu_tests.log"))
        t.guarded("contexts", contexts, t.add, device, cuda, t.left(120))
        small = runs.UPDATES_SIZE if cuda else size
        t.guarded("updates", updates, t, small, device, topology, Path(tmp), args.steps)
        t.guarded("LoRA over a quantized base", quantized_lora, t, device, args.steps)
        t.guarded("HF layers' kept bytes", hf_counts, t, device, Path(tmp))
        t.guarded("two ranks", two_ranks, t, Path(tmp), torch.cuda.device_count() if cuda else 2, cuda)
    t.save()
    failed = t.failed()
    print(f"{tally(t.rows)}; {args.out}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


def nvidia_driver() -> str | None:
    """The NVIDIA driver this host runs (its /proc version line), None where there is none."""
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


def unusable_gpu(driver: str | None, cuda: bool) -> str | None:
    """Why a host with an NVIDIA driver has no GPU for this torch (None: it has one, or there is no GPU here, where
    the checks run on the stand-ins): a CPU build of torch, or one whose CUDA the driver is too old for. Without this
    a GPU server on a CPU torch ran the stand-ins and passed them."""
    if driver is None or cuda:
        return None
    if torch.version.cuda is None:
        return (
            f"the NVIDIA driver is here ({driver[:60]}) but torch {torch.__version__} is a CPU build: install the CUDA "
            f"build (scripts/setup.sh does, over a CPU .venv; or PYTHON=a python whose torch has CUDA)"
        )
    return (
        f"the NVIDIA driver is here ({driver[:60]}) but torch {torch.__version__} (CUDA {torch.version.cuda}) finds "
        f"no usable GPU: a driver older than its CUDA needs, or no GPU visible to this process (CUDA_VISIBLE_DEVICES, "
        f"a container without --gpus); `nvidia-smi` shows the driver's CUDA version"
    )


if __name__ == "__main__":
    sys.exit(main())
