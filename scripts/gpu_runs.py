"""The runs scripts/gpu_check.py compares: a GPT through the Pipeline under a policy and tier, the same GPT in
plain PyTorch (forward and backward on the same device, the same CPU AdamW on an fp32 master), and the
machine's copy rate; each returns plain numbers and tensors."""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import gpu_memory
import gpu_trace
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig
from mobiuspipe.memory.reduce import sum_of_squares
from mobiuspipe.models.gpt import build_layers, layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.clipping import clip_scale
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.profiling.profiler import TORCH_DTYPES, measure_profile
from mobiuspipe.runtime.action_trace import write_chrome
from mobiuspipe.runtime.activations import ActivationsSpec
from mobiuspipe.startup.swaps import plan_as_run, swap_tiers
from partition import make_plan
from partition.plan import Plan
from partition.rules.device_peak import planned_device_bytes
from partition.spec.models import ModelSpec

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.05


@dataclass(frozen=True)
class Size:
    """The GPT and its batches: a mid-size one on a GPU, a small one on the CPU stand-ins."""

    d_model: int
    heads: int
    blocks: int
    seq: int
    vocab: int
    batch: int
    microbatches: int
    stages: int

    def spec(self) -> ModelSpec:
        return ModelSpec("gpt-check", self.blocks, self.d_model, self.heads, self.seq, self.vocab)


LORA_SIZE = Size(d_model=128, heads=4, blocks=4, seq=64, vocab=512, batch=8, microbatches=4, stages=4)
"""A LoRA base small enough for both machines whose qkv (128 x 384) and fc (128 x 512) weights NF4's blocks divide."""
LORA_TARGETS = ("qkv", "fc")
GPU_SIZE = Size(d_model=1024, heads=16, blocks=8, seq=512, vocab=8192, batch=8, microbatches=4, stages=8)
CPU_SIZE = Size(d_model=48, heads=4, blocks=8, seq=32, vocab=256, batch=8, microbatches=4, stages=8)
UPDATES_SIZE = Size(d_model=256, heads=4, blocks=6, seq=128, vocab=2048, batch=8, microbatches=4, stages=8)
"""The updates check's GPT on a GPU: the paths (pinned versions, rollbacks) do not depend on the size; the time does."""


@dataclass
class Run:
    """What one run gives: each step's loss, the final weights (host, by "layer.param"), each step's seconds, and
    the device figures (bytes) the checks read."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    step_s: list[float]
    skipped: list[bool] = field(default_factory=list)
    rolled_back: list[int] = field(default_factory=list)
    """Each step's speculative updates rolled back (the step clipped or overflowed)."""
    peak_bytes: int = 0
    """The runtime's measured device peak: the ledger's on the stand-in, max_memory_allocated on CUDA."""
    reserved_bytes: int = 0
    used_bytes: int = 0
    """CUDA: total - free of mem_get_info at the end (the context, NCCL and the allocator's cache included)."""
    planned_bytes: int = 0
    before_bytes: int = 0
    """CUDA: what the process held before the run (cuBLAS workspaces, earlier runs' leftovers), in peak_bytes too."""
    load_wait_s: float = 0.0
    """The compute thread's seconds waiting for loads, summed over the steps after the first."""
    loaded_bytes: int = 0
    """Bytes one step moves host -> device (weights loaded) and back (gradients offloaded)."""
    pinned_bytes: int = 0
    """Host bytes the run's Device page-locked at its end (Device.pinned_bytes: registered at each buffer's size on
    CUDA; 0 on the stand-in)."""
    ledger_parts: dict[str, int] = field(default_factory=dict)
    """The runtime's ledger by kind (arena, inputs, saved, inbox, ...) at its peak in the step of the largest peak:
    what the runtime knows it holds; the allocator's peak beyond it is transients and libraries' buffers."""


def batches(size: Size, steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(0, size.vocab, (rows, size.seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def make_plan_for(size: Size, precision: str, device: torch.device, topology) -> Plan:
    """A plan of size.stages stages on one gpu from the layers' profile measured on this device."""
    dtype = TORCH_DTYPES[precision]
    layers = [m().to(dtype) for m in layer_factories(size.spec(), seed=3)]
    (x, y), rows = batches(size, 1, size.batch)[0], size.batch // size.microbatches
    profile = measure_profile(
        layers,
        x[:rows],
        device=device,
        name="gpt-check",
        device_name=topology.gpus[0].name,
        dtype_name=precision,
        microbatch_size=rows,
        seq_len=size.seq,
        loss_fn=lambda out: lm_loss(out.float(), y[:rows].to(out.device)),
    )
    return make_plan(profile, topology, size.microbatches, num_stages=size.stages, mapping="cross", solver="dp")


def pipeline_run(
    size: Size,
    plan: Plan,
    precision: str,
    steps: int,
    *,
    activations: ActivationsSpec = "recompute",
    memory: MemoryConfig | None = None,
    accumulation: int = 1,
    scaler: LossScaler | None = None,
    clip: float | None = None,
    delayed: int | None = None,
    speculative: bool = True,
) -> Run:
    """steps steps of the GPT through a Pipeline on this rank's gpu; clip, delayed and speculative: the Pipeline's
    max_grad_norm, delayed_update and speculative_update."""
    torch.manual_seed(0)
    rows = size.batch * accumulation
    data = batches(size, steps, rows)
    memory = memory or MemoryConfig()
    run = Run([], {}, [])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        run.before_bytes = torch.cuda.memory_allocated()
    with Pipeline(
        layer_factories(size.spec(), seed=3),
        lm_loss,
        plan=plan,
        optimizer=partial(CPUAdam, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        precision=precision,
        memory=memory,
        activations=activations,
        accumulation_steps=accumulation,
        loss_scaler=scaler,
        max_grad_norm=clip,
        delayed_update=delayed,
        speculative_update=speculative,
    ) as pipe:
        for step, (x, y) in enumerate(data):
            start = time.perf_counter()
            r = pipe.train_batch(x, y)
            pipe.engine.device.synchronize()
            run.step_s.append(time.perf_counter() - start)
            run.losses.append(r.loss)
            run.skipped.append(bool(r.skipped))
            run.rolled_back.append(r.updates_rolled_back)
            run.load_wait_s += r.own_times.load_s if step else 0.0
        run.weights = pipe.state_dict()
        run.peak_bytes = pipe.engine.peak.run_bytes
        run.ledger_parts = dict(pipe.engine.peak.run_parts)
        run.loaded_bytes = _moved_bytes(pipe)
        run.pinned_bytes = pipe.engine.device.pinned_bytes
        as_run = plan_as_run(pipe.plan, pipe.activations, swap_tiers(pipe.plan, memory, pipe.activations))
        cuda = torch.cuda.is_available()
        run.planned_bytes = planned_device_bytes(as_run, not cuda, sends_until_flush=False)[0]
    if torch.cuda.is_available():
        run.peak_bytes = torch.cuda.max_memory_allocated()
        run.reserved_bytes = torch.cuda.max_memory_reserved()
        free, total = torch.cuda.mem_get_info()
        run.used_bytes = total - free
    return run


Peaks = list[tuple[tuple[str, int, int], int]]
"""((kind, stage, microbatch), bytes) per action, in the schedule's order."""


def action_peaks(size: Size, plan: Plan, steps: int = 2) -> tuple[Peaks, Plan]:
    """Each action's device bytes in the last of `steps` fp32 steps, and the plan as the run ran it: on CUDA the
    allocator's peak while the action ran, less what the process held before the run; on the stand-in the ledger's
    bytes once it ended (the ledger counts no transients). The actions are watched through the engine's dispatch
    table: the runtime keeps no per-action figure of its own."""
    data = batches(size, steps, size.batch)
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else 0
    peaks: Peaks = []
    with Pipeline(layer_factories(size.spec(), seed=3), lm_loss, plan=plan) as pipe:
        engine, ledger = pipe.engine, pipe.engine.compute.ledger

        def watched(run, a):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            run(a)
            got = torch.cuda.max_memory_allocated() - before if cuda else ledger.bytes
            peaks.append(((a.kind.value, a.stage, a.microbatch), got))

        engine._dispatch = {kind: partial(watched, run) for kind, run in engine._dispatch.items()}
        for x, y in data:
            peaks.clear()
            pipe.train_batch(x, y)
        as_run = plan_as_run(pipe.plan, pipe.activations, swap_tiers(pipe.plan, MemoryConfig(), pipe.activations))
    return peaks, as_run


def _moved_bytes(pipe: Pipeline) -> int:
    """Bytes one step moves between host and device: each LOAD's weights, each stage's gradients once."""
    loads = [a.stage for a in pipe.engine.schedule if a.kind.value == "L"]
    stages = pipe.engine.stages
    return sum(stages[j].nbytes for j in loads) + sum(s.nbytes for s in stages.values())


def plain_run(
    size: Size,
    precision: str,
    steps: int,
    device: torch.device,
    accumulation: int = 1,
    clip: float | None = None,
    delayed: int | None = None,
) -> Run:
    """The pipeline's precision recipe without a pipeline: the GPT as one nn.Sequential on `device` in the
    training dtype, each microbatch's loss in fp32 divided by the microbatch count, the gradients accumulated over the
    same microbatches in the training dtype, an fp32 master on the host stepped by CPUAdam (in bf16/fp16 its step_fused,
    which writes the next low-precision weights in the same pass). With accumulation, each pass's gradients are summed
    on the device and the passes' sums added on the host, in order, as the tiers do. clip: the host gradients scaled as
    torch.nn.utils.clip_grad_norm_ scales them, in the pipeline's arithmetic (_clipped). delayed: from step `delayed`
    on, step s computes on the weights before step s - 1's update, which is applied after step s's gradients
    (train.delayed_update's rule); the last one held back is applied at the end."""
    dtype = TORCH_DTYPES[precision]
    spec = size.spec()
    layers = build_layers(spec, seed=3)
    model = nn.Sequential(*(layers[l] for l in range(spec.num_layers)))
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]  # fp32, before the cast
    model = model.to(device, dtype)
    opt = CPUAdam(master, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    m = size.microbatches * accumulation
    run, held = Run([], {}, []), None
    for step, (x, y) in enumerate(batches(size, steps, size.batch * accumulation)):
        start = time.perf_counter()
        total, grads = 0.0, []
        for xp, yp in zip(x.chunk(accumulation), y.chunk(accumulation)):
            model.zero_grad(set_to_none=False)
            for xi, yi in zip(xp.chunk(size.microbatches), yp.chunk(size.microbatches)):
                loss = lm_loss(model(xi.to(device)).float(), yi.to(device)) / m
                loss.backward()
                total += float(loss.detach())
            got = [_grad(p).to("cpu", copy=True) for p in model.parameters()]
            grads = got if not grads else [g.add_(h) for g, h in zip(grads, got)]
        if clip is not None:
            grads = _clipped(grads, clip)
        if held is not None:
            _apply(model, opt, master, held)
            held = None
        if delayed is not None and step + 1 >= delayed:
            held = grads
        else:
            _apply(model, opt, master, grads)
        if device.type == "cuda":
            torch.cuda.synchronize()
        run.step_s.append(time.perf_counter() - start)
        run.losses.append(total)
    if held is not None:
        _apply(model, opt, master, held)
    names = [f"{l}.{n}" for l in range(spec.num_layers) for n, _ in layers[l].named_parameters()]
    run.weights = {n: w.detach().clone() for n, w in zip(names, master)}
    return run


def _clipped(grads: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """The gradients scaled by clip_grad_norm_'s coefficient where it is below 1, in the pipeline's arithmetic: the
    squared norm summed in float64 (weight_stream.sum_of_squares), the factor the updates divide the gradients by
    from mobiuspipe.optim.clipping, and the gradients multiplied by its inverse (StageStates' update)."""
    _, scale = clip_scale(sum(sum_of_squares(g) for g in grads), 1.0, clip)
    return [g.mul_(1.0 / scale) for g in grads] if scale != 1.0 else grads


def _apply(model: nn.Module, opt: CPUAdam, master: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """One CPUAdam step of the fp32 master on `grads`, its result written into the model's weights (cast)."""
    if grads[0].dtype == torch.float32:
        for g, w in zip(grads, master):
            w.grad = g
        opt.step()
        lows = [w.detach() for w in master]
    else:
        lows = [torch.empty_like(g) for g in grads]
        opt.step_fused(dict(zip(master, lows)), grads=dict(zip(master, grads)))
    with torch.no_grad():
        for p, low in zip(model.parameters(), lows):
            p.copy_(low)


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:  # every weight of the GPT gets a gradient: a missing one is a bug in the model
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} got no gradient")
    return p.grad.detach()


def h2d_gbps(device: torch.device, nbytes: int) -> float:
    """GB/s of a pinned host -> device copy of nbytes (the CPU stand-in: a memcpy), median of 5."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def steady(times: list[float], skip: int) -> float:
    """The median of the step times after the first `skip` (all of them if there are no more)."""
    return statistics.median(times[skip:] if len(times) > skip else times)


def memory_report(size: Size, plan: Plan, path: str, steps: int = 3) -> list[str]:
    """The CUDA allocator's history over `steps` fp32 steps, recorded with each allocation's Python stack: what was
    live at the run's peak, by the place in our code that allocated it (gpu_memory.summary); written to path too."""
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        pipeline_run(size, plan, "fp32", steps)
        lines = gpu_memory.summary(torch.cuda.memory._snapshot())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    Path(path).write_text("\n".join(lines) + "\n")
    return lines


def gpu_topology():
    """This host's gpu 0 as NVML and sysfs show it (mobiuspipe.startup.machine)."""
    from mobiuspipe.startup.machine import discovered_topology

    return discovered_topology(1)


def overlap_on_gpu(size: Size, plan: Plan, precision: str, steps: int = 3, trace: str | None = None) -> dict:
    """(b) on CUDA: a torch.profiler trace of `steps` steps after one warm-up (kept at `trace` as Chrome JSON if
    given, and the pipeline's own trace of its actions beside it, as TRACE.actions.json), read by gpu_trace: the
    share of the host -> device copy time the compute did not wait through, and the host-blocking synchronizations
    per step of the threads that launch the compute."""
    from torch.profiler import ProfilerActivity, profile

    data = batches(size, steps + 1, size.batch)
    traced = range(1, steps + 1) if trace else ()
    with Pipeline(
        layer_factories(size.spec(), seed=3), lm_loss, plan=plan, precision=precision, trace_steps=traced
    ) as pipe:
        pipe.train_batch(*data[0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for x, y in data[1:]:
                pipe.train_batch(x, y)
            torch.cuda.synchronize()
        visits = sum(a.kind.value in ("F", "B") and a.microbatch == 0 for a in pipe.engine.schedule)
    with tempfile.TemporaryDirectory(prefix="gpu-trace-") as tmp:
        path = Path(trace or Path(tmp) / "trace.json")
        prof.export_chrome_trace(str(path))
        found = gpu_trace.overlap(gpu_trace.load(path), steps, visits)
    if trace:  # beside the kernels and copies: the pipeline's actions and host updates ("U"), all ended now
        write_chrome([list(pipe.trace.records)], Path(trace).with_suffix(".actions.json"))
    return found


def lora_runs(
    base_dtype: str, steps: int, device: torch.device, optimizer: str = "host"
) -> tuple[list[float], list[float]]:
    """LORA_SIZE's GPT with rank-8 adapters on LORA_TARGETS over a `base_dtype` base (mobiuspipe.lora.quant), fp32,
    the adapters' states in memory.optimizer `optimizer` (host, or device: on the gpu): (the Pipeline's losses, plain
    PyTorch's), the latter the same quantized layers as one nn.Sequential on `device`, their adapters stepped by
    CPUAdam on an fp32 host master over the same microbatches."""
    from mobiuspipe import LoraSpec
    from mobiuspipe.lora.layers import with_adapters
    from mobiuspipe.lora.quant import quantized

    size, lora = LORA_SIZE, LoraSpec(rank=8, alpha=16.0, targets=LORA_TARGETS, base_dtype=base_dtype)
    data = batches(size, steps, size.batch)
    opt = partial(CPUAdam, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    torch.manual_seed(0)  # the adapters are drawn from the seed torch has when the layers are built
    with Pipeline(
        layer_factories(size.spec(), seed=3),
        lm_loss,
        sample=data[0],
        num_microbatches=size.microbatches,
        num_stages=size.stages,
        optimizer=opt,
        lora=lora,
        memory=MemoryConfig(optimizer=optimizer),
    ) as pipe:
        got = [pipe.train_batch(x, y).loss for x, y in data]
    torch.manual_seed(0)
    makers = quantized(with_adapters(layer_factories(size.spec(), seed=3), lora), base_dtype)
    model = nn.Sequential(*(make() for make in makers)).to(device)
    trained = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().to("cpu", copy=True).requires_grad_(True) for p in trained]
    adam = opt(master)
    want = []
    for x, y in data:
        model.zero_grad(set_to_none=False)
        total = 0.0
        for xi, yi in zip(x.chunk(size.microbatches), y.chunk(size.microbatches)):
            loss = lm_loss(model(xi.to(device)).float(), yi.to(device)) / size.microbatches
            loss.backward()
            total += float(loss.detach())
        for w, p in zip(master, trained):
            w.grad = _grad(p).to("cpu", copy=True)
        adam.step()
        with torch.no_grad():
            for p, w in zip(trained, master):
                p.copy_(w.detach())
        want.append(total)
    return got, want


def hf_kept(device: torch.device, folder: Path) -> list[tuple[str, float, tuple[float, int] | None]]:
    """What small random GPT-2 (its default dropouts) and Llama (grouped queries) layers keep for backward on
    `device` (measure_layers: saved-tensor hooks) over what the analytic profile counts, the most of any layer, for
    bf16 and fp32, and likewise the transients their backward allocates beyond it (X_l: the allocator's peak, on
    CUDA; None on the stand-in, which measures none): [(name, kept ratio, (transients ratio, the most bytes a
    layer's measured X is over its count))]; the ratios at most 1 where the count holds on this device's kernels
    (the allocator rounds each block to 512 bytes: the bytes over say whether that is all)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from mobiuspipe.models.hf import layer_factories as hf_factories
    from mobiuspipe.models.hf import open_hf
    from partition.spec.analytic import analytic_profile
    from partition.spec.hardware import DeviceSpec, device_spec

    s, b, vocab = 256, 2, 1000
    configs = {
        "gpt2": GPT2Config(vocab_size=vocab, n_embd=256, n_layer=1, n_head=4, n_positions=s, bos_token_id=0,
                           eos_token_id=0),
        "llama": LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=s),
    }  # fmt: skip
    cuda = device.type == "cuda"  # a GPU's kernels fuse attention's dropout; its rate does not matter here
    spec_device = DeviceSpec(torch.cuda.get_device_name(device), 1.0, 0, 1.0) if cuda else device_spec("cpu-standin")
    out = []
    for kind, config in configs.items():
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder / kind))
        m = open_hf(folder / kind, s)
        x, y = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s), device=device)
        for dtype in ("bf16", "fp32"):
            layers = [f().to(TORCH_DTYPES[dtype]).train() for f in hf_factories(m)]
            kw = dict(name=kind, device_name=spec_device.name, dtype_name=dtype, microbatch_size=b, seq_len=s)
            loss = partial(_float_loss, targets=y)
            measured = measure_profile(layers, x, device=device, loss_fn=loss, warmup=0, min_repeats=1, max_repeats=1,
                                       **kw)  # fmt: skip
            counted = analytic_profile(m.spec, spec_device, microbatch_size=b, dtype=dtype)
            pairs = list(zip(measured.layers, counted.layers))
            kept = max(g.activation_bytes / c.activation_bytes for g, c in pairs if c.activation_bytes)
            spent = None
            if cuda:
                ratio = max(g.workspace_bytes / c.workspace_bytes for g, c in pairs)
                spent = (ratio, max(g.workspace_bytes - c.workspace_bytes for g, c in pairs))
            out.append((f"{kind} {dtype}", kept, spent))
    return out


def _float_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The runtime's loss: on fp32 logits."""
    return lm_loss(logits.float(), targets)
