"""Measured per-layer profile: run each layer's forward and backward on a device and time it, same format
as partition.spec.analytic.

For each layer l, fed the previous layer's output (the first gets `sample_input`):
  fwd_s, recompute_s, bwd_s, kept_s
                    the layer timed on the runtime's own path (mobiuspipe.runtime.stage: functional_call on the
                    layer's tensors, so its per-call cost is in the figures): fwd_s the forward of a
                    forward visit (no grad), recompute_s the forward with grad of a backward visit under
                    the ledger's saved-tensor hook (memory.measure.counting_saved; the hook costs some
                    10-40% on small layers), bwd_s the backward and the drop of the hook's records,
                    kept_s the forward of a keep stage's forward visit: with grad on leaves viewing one
                    weight slot, under the keep hooks (mobiuspipe.runtime.activations.keeping), `microbatches`
                    in a row with every graph held until the last has run (each in fresh memory), the
                    mean of the `microbatches`; None for the last layer with its loss (the last stage's
                    forward is fused into its backward).
                    Each the median of the last `min_repeats` timings once those medians move by at most
                    rel_tol from one repeat to the next (or after max_repeats), after `warmup` untimed
                    runs; the device is synchronized before and after each timed region (CUDA), so the
                    clock sees the kernels, not their launch
  param_count/bytes the layer's real parameters (numel, nbytes)
  activation_bytes  the tensors autograd saves for backward (saved_tensors_hooks), counted once per
                    storage (views share one), parameters excluded; the last layer includes its loss
  output_bytes      nbytes of the layer's output
  buffer_bytes      the layer's buffers as a stage keeps them on its gpu the whole run (floating ones in the
                    profile's dtype, mobiuspipe.runtime.stage), each tensor once
  library_bytes     CUDA only (0 on the stand-in): the bytes cuBLAS and cuBLASLt keep for a stream (the
                    profile's, once per model)
  workspace_bytes   CUDA only (0 on the stand-in): the allocator's peak over a recompute and its
                    backward (after the timed runs, so the kernels' own workspaces already exist), less
                    what was allocated once the recompute ended (what it saved and its output, and
                    everything held before)
  fwd/bwd_flops     torch.utils.flop_counter.FlopCounterMode (matmuls and attention; norms, activations
                    and gathers count 0), plus the CPU flash-attention kernel, which it does not know
Layer similarity (Mobius, "Profiling"): a layer whose type, parameter and buffer shapes and dtypes, and
input shape and dtype equal an earlier layer's is not run again: it gets that layer's numbers, and the
next layer is fed that layer's recorded output. `measure_layers` returns which layers ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.utils.flop_counter as flop_counter
from torch import nn
from torch.func import functional_call

from foundation.timing import Stopwatch
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.measure import counting_saved
from mobiuspipe.runtime.activations import keeping
from partition.spec.profile import LayerProfile, Profile

__all__ = ["Measurement", "home_of", "measure_layers", "measure_profile"]

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Measurement:
    """A measured profile and, for each layer, the index of the layer whose run produced its numbers."""

    profile: Profile
    source: tuple[int, ...]
    """source[l] == l: layer l was run; otherwise it copies layer source[l] (layer similarity)."""

    @property
    def measured(self) -> tuple[int, ...]:
        """Indices of the layers actually run."""
        return tuple(l for l, s in enumerate(self.source) if s == l)


def _check(layers, warmup: int, min_repeats: int, max_repeats: int, rel_tol: float) -> None:
    if not layers:
        raise ValueError("measure_profile needs at least one layer, found an empty list")
    if warmup < 0 or not 1 <= min_repeats <= max_repeats or not rel_tol > 0:
        raise ValueError(
            f"need warmup >= 0, 1 <= min_repeats <= max_repeats and rel_tol > 0; found warmup "
            f"{warmup}, min_repeats {min_repeats}, max_repeats {max_repeats}, rel_tol {rel_tol}"
        )


def _signature(layer: nn.Module, x: torch.Tensor) -> tuple:
    tensors = [*layer.named_parameters(), *layer.named_buffers()]
    return (type(layer), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors), tuple(x.shape), x.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SDPA_KERNELS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The attention kernels (each with a `_backward`) whose flops _attention_flops counts, where this torch has them."""


def _query_heads(q, k, v) -> tuple:
    """The shapes (batch, heads, seq, dim) of q, k and v with k and v given the query's heads: grouped-query
    attention hands a kernel fewer key/value heads, but it computes every query head against them."""
    return q, (k[0], q[1], *k[2:]), (v[0], q[1], *v[2:])


def _attention_flops() -> dict:
    """FlopCounterMode formulas for the attention kernels on the CPU and CUDA, counted at the query's heads: torch's
    own (and torch 2.11's sdpa_flop_count, the GPU image's) refuse a grouped-query attention's fewer key/value heads,
    and torch has none for the CPU's flash kernel before 2.13."""
    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(*_query_heads(q, k, v))

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, *_query_heads(q, k, v))

    formulas = {}
    for name in SDPA_KERNELS:
        for op, formula in ((name, fwd), (f"{name}_backward", bwd)):
            if hasattr(aten, op):
                formulas[getattr(aten, op)] = formula
    return formulas


class _Run:
    """One layer on the device, called as the runtime's Stage calls it (torch.func.functional_call on the
    layer's tensors): the forward without grad (a forward visit), the forward with grad on weight leaves
    under the ledger's saved-tensor hook (the recompute of a backward visit, with the loss for the last
    layer), and the backward with a fixed gradient, after which the hook's records are dropped."""

    def __init__(self, layer: nn.Module, x: torch.Tensor, loss_fn, device: torch.device, microbatches: int):
        self.layer, self.loss_fn, self.device, self.microbatches = layer, loss_fn, device, microbatches
        self.x = x.detach().requires_grad_(x.is_floating_point())
        self.params = list(layer.parameters())
        self.leaves = {n: p.detach().requires_grad_(p.requires_grad) for n, p in layer.named_parameters()}
        for t in self.leaves.values():  # the runtime's leaves accumulate into the gradient slot's views
            t.grad = torch.zeros_like(t) if t.requires_grad else None
        self.leaves.update(dict(layer.named_buffers()))
        self.plain = {n: t.detach() for n, t in self.leaves.items()}
        self.buffers = dict(layer.named_buffers())
        # a kept forward's weight slot: not for the layer with its loss (the fused last stage keeps nothing)
        self.slot, self.in_slot = (None, {}) if loss_fn else _weight_slot(layer, device)
        self.ledger = DeviceLedger()
        with torch.no_grad():
            out = layer(self.x)
        self.out = out.detach()
        g = torch.Generator().manual_seed(0)
        self.grad = None if loss_fn else torch.randn(out.shape, generator=g).to(device, out.dtype)

    def forward(self) -> torch.Tensor:
        """The forward with grad as the flop count and the saved-bytes count see it (the module's own call)."""
        out = self.layer(self.x)
        return self.loss_fn(out) if self.loss_fn else out

    def forward_visit(self) -> None:
        with torch.no_grad():
            functional_call(self.layer, self.plain, (self.x.detach(),))

    def recompute(self) -> torch.Tensor:
        with counting_saved(self.ledger):
            out = functional_call(self.layer, self.leaves, (self.x,))
            self.ledger.hold(("output",), out)
            return self.loss_fn(out) if self.loss_fn else out

    def backward(self, y: torch.Tensor) -> None:
        if y.requires_grad:  # a layer without parameters on an integer input has no backward
            y.backward(self.grad)
        self.ledger.drop_kind("autograd")
        self.ledger.drop_kind("output")
        self.x.grad = None

    def kept_visit(self) -> float:
        """Seconds per forward of `microbatches` kept forwards in a row (each graph held until all have run);
        their backwards follow, untimed."""
        slot = self.slot
        if slot is None:
            raise RuntimeError("kept_visit on the layer with its loss: it has no kept forward (a bug)")
        outs, total = [], 0.0
        for i in range(self.microbatches):
            trains = {n: t.requires_grad for n, t in self.leaves.items()}  # frozen (LoRA's base) ones stay frozen
            tensors = {n: v.detach().requires_grad_(trains[n]) for n, v in self.in_slot.items()} | self.buffers
            _sync(self.device)
            with Stopwatch() as sw, keeping(self.ledger, ("kept", i), slot, lambda: slot):
                outs.append(functional_call(self.layer, tensors, (self.x,)))
                _sync(self.device)
            total += sw.s
        for out in outs:
            if out.requires_grad:
                out.backward(self.grad)
        self.ledger.drop_kind("kept")
        self.x.grad = None
        return total / self.microbatches

    def timed(self) -> tuple[float, ...]:
        """Seconds of (forward visit, recompute, backward, kept forward); the last 0.0 for a layer with its loss."""
        kept = 0.0 if self.loss_fn else self.kept_visit()
        _sync(self.device)
        with Stopwatch() as fwd:
            self.forward_visit()
            _sync(self.device)
        with Stopwatch() as redo:
            y = self.recompute()
            _sync(self.device)
        with Stopwatch() as bwd:
            self.backward(y)
            _sync(self.device)
        return fwd.s, redo.s, bwd.s, kept

    def flops(self) -> tuple[float, float]:
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_attention_flops()) as f:
            y = self.forward()
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_attention_flops()) as b:
            self.backward(y)
        return float(f.get_total_flops()), float(b.get_total_flops())

    def workspace_bytes(self) -> int:
        """X_l: on CUDA, the allocator's peak over a recompute and its backward less what was allocated once the
        recompute ended (the saved activations and the output, which A_l and O_l count, and all held before); 0
        elsewhere (the stand-in's ledger counts no transients). The allocator's cache is emptied first: a cached block
        up to 1 MiB larger than asked would be handed out whole, and counted whole."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        y = self.recompute()
        torch.cuda.synchronize(self.device)
        kept = torch.cuda.memory_allocated(self.device)
        self.backward(y)
        del y
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - kept)

    def saved_bytes(self) -> int:
        """A_l: the bytes of the device's memory the layer's forward keeps for its backward, its parameters left
        out, and what it keeps elsewhere (on CUDA, flash and memory-efficient attention keep their philox seed
        and offset in host memory)."""
        params = {p.untyped_storage().data_ptr() for p in self.params}
        device = torch.device(self.device)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            here = t.device.type == device.type and device.index in (None, t.device.index)
            if here and s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = self.forward()
        self.backward(y)
        return sum(seen.values())


def _weight_slot(layer: nn.Module, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 buffer holding a copy of the layer's parameters, as an arena slot holds a stage's, and a view of
    each parameter in it."""
    # the widest items first, as the stage lays out mixed dtypes (an NF4 base): every offset a multiple of its item
    named = sorted(layer.named_parameters(), key=lambda x: -x[1].element_size())
    widest = max((p.element_size() for _, p in named), default=1)
    size = -(-sum(p.nbytes for _, p in named) // widest) * widest  # whole items of every dtype
    slot = torch.empty(size, dtype=torch.uint8, device=device)
    views, offset = {}, 0
    for name, p in named:
        views[name] = slot[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
        views[name].copy_(p.detach())
        offset += p.nbytes
    return slot, views


def _stable_median(run: _Run, warmup: int, min_repeats: int, max_repeats: int, rel_tol: float) -> tuple[float, ...]:
    for _ in range(warmup):
        run.timed()
    times: list[tuple[float, ...]] = []
    last = None
    for _ in range(max_repeats):
        times.append(run.timed())
        if len(times) < min_repeats:
            continue
        now = tuple(statistics.median(col) for col in zip(*times[-min_repeats:]))
        if last and all(abs(n - o) <= rel_tol * n for n, o in zip(now, last)):
            break
        last = now
    return now


def _trainable(params: list[nn.Parameter]) -> int | None:
    """The parameters that train (T_l), or None when all do (a LoRA layer: its adapters)."""
    trains = sum(p.numel() for p in params if p.requires_grad)
    return None if trains == sum(p.numel() for p in params) else trains


def _measure_one(
    layer: nn.Module, x: torch.Tensor, loss_fn, device: torch.device, timing: tuple[int, int, int, float], m: int
) -> tuple[LayerProfile, torch.Tensor]:
    run = _Run(layer, x, loss_fn, device, m)
    fwd_flops, bwd_flops = run.flops()
    act = run.saved_bytes()
    fwd_s, redo_s, bwd_s, kept_s = _stable_median(run, *timing)  # warm: the kernels' own workspaces exist
    workspace = run.workspace_bytes()
    for p in layer.parameters():
        p.grad = None
    params = list(layer.parameters())
    lp = LayerProfile(
        name=type(layer).__name__.lower(),
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.nbytes for p in params),
        trainable_count=_trainable(params),
        activation_bytes=act,
        output_bytes=run.out.nbytes,
        fwd_flops=fwd_flops,
        bwd_flops=bwd_flops,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        recompute_s=redo_s,
        kept_s=None if loss_fn else kept_s,
        workspace_bytes=workspace,
    )
    return lp, run.out


def _check_dtype(layers: Sequence[nn.Module], dtype_name: str) -> None:
    if dtype_name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; accepted: {', '.join(TORCH_DTYPES)}")
    for l, layer in enumerate(layers):
        # floating parameters only: integer ones are a quantized frozen base's codes (mobiuspipe.lora.quant)
        wrong = {p.dtype for p in layer.parameters() if p.is_floating_point()} - {TORCH_DTYPES[dtype_name]}
        if wrong:
            raise ValueError(
                f"layer {l} has {sorted(map(str, wrong))} parameters but dtype_name is {dtype_name!r} "
                f"({TORCH_DTYPES[dtype_name]}); cast the layers (layer.to(dtype)) or name their dtype"
            )


def measure_layers(
    layers: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    device,
    name: str,
    device_name: str,
    dtype_name: str,
    microbatch_size: int,
    seq_len: int,
    loss_fn=None,
    warmup: int = 2,
    min_repeats: int = 5,
    max_repeats: int = 50,
    rel_tol: float = 0.05,
    microbatches: int = 4,
) -> Measurement:
    """Measure `layers` in order (see the module docstring); loss_fn(output) -> scalar follows the last one;
    microbatches: the kept forwards timed in a row (the plan's microbatches per visit).

    Each layer is moved to `device` for its measurement and back where it was afterwards, so the device
    holds one layer at a time. The Profile's header fields are the given name, device_name, dtype_name,
    microbatch_size and seq_len.
    """
    _check(layers, warmup, min_repeats, max_repeats, rel_tol)
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (the kept forwards timed in a row), found {microbatches}")
    _check_dtype(layers, dtype_name)
    device = torch.device(device)
    x = sample_input.to(device, copy=True)  # its own storage, as the runtime's microbatch: not a slice of a batch
    seen: dict[tuple, tuple[int, torch.Tensor]] = {}
    out_layers: list[LayerProfile] = []
    source: list[int] = []
    for l, layer in enumerate(layers):
        key = (_signature(layer, x), l == len(layers) - 1 and loss_fn is not None)
        if key not in seen:
            home = home_of(layer)
            layer.to(device)
            lp, y = _measure_one(
                layer,
                x,
                loss_fn if l == len(layers) - 1 else None,
                device,
                (warmup, min_repeats, max_repeats, rel_tol),
                microbatches,
            )
            lp = dataclasses.replace(lp, buffer_bytes=_buffer_bytes(layer, TORCH_DTYPES[dtype_name]))
            if home is not None:
                layer.to(home)
            seen[key] = (l, y)
            out_layers.append(lp)
        else:
            out_layers.append(out_layers[seen[key][0]])
        source.append(seen[key][0])
        x = seen[key][1]
    profile = Profile(
        model=name,
        device=device_name,
        dtype=dtype_name,
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        layers=tuple(out_layers),
        input_bytes=sample_input.numel() * sample_input.element_size(),
        library_bytes=library_bytes(device, TORCH_DTYPES[dtype_name]),
    )
    return Measurement(profile=profile, source=tuple(source))


def _buffer_bytes(layer: nn.Module, dtype: torch.dtype) -> int:
    """V_l: the bytes of layer's buffers as a stage holds them, floating ones in `dtype`."""
    return sum(b.numel() * (dtype.itemsize if b.is_floating_point() else b.element_size()) for b in layer.buffers())


def home_of(layer: nn.Module) -> torch.device | None:
    """Where layer's tensors are, its parameters' or else its buffers' (None: it holds none)."""
    first = next(itertools.chain(layer.parameters(), layer.buffers()), None)
    return None if first is None else first.device


def library_bytes(device: torch.device, dtype: torch.dtype) -> int:
    """W on CUDA: the bytes cuBLAS and cuBLASLt keep for a stream once a linear layer's forward and backward have run
    on it (their workspaces, one set per stream, held until the process ends), measured after clearing the ones the
    process holds; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    start = torch.cuda.memory_allocated(device)
    probe = nn.Linear(64, 64, device=device, dtype=dtype)
    x = torch.randn(8, 64, device=device, dtype=dtype, requires_grad=True)
    probe(x).float().sum().backward()
    torch.matmul(x.detach(), probe.weight.detach())
    del probe, x
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.memory_allocated(device) - start)


def measure_profile(layers: Sequence[nn.Module], sample_input: torch.Tensor, **kwargs) -> Profile:
    """measure_layers(...).profile: the measured Profile alone (same keyword arguments)."""
    return measure_layers(layers, sample_input, **kwargs).profile
