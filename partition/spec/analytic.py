"""Analytical per-layer profile of a GPT or LLaMA (FLOPs, bytes, seconds) on a device type, without running it.

Legend (for ONE microbatch; units in brackets):
  s    seq_len, tokens per sequence                                                    [-]
  b    microbatch_size, sequences per microbatch                                       [-]
  h    d_model, hidden size                                                            [-]
  a    num_heads                                                                       [-]
  k    kv_heads (llama: grouped-query attention; gpt: k = a)                           [-]
  hd   head_dim, h / a                                                                 [-]
  f    ffn, the MLP width (gpt default 4h)                                             [-]
  m    block_matmul_params: gpt 4h^2 + 2hf (= 12h^2 at f = 4h); llama 2h^2 + 2h*k*h/a + 3hf  [-]
  V    vocab_size                                                                      [-]
  e    bytes per element: 2 for fp16/bf16, 4 for fp32                                  [bytes]
  n_l  parameters of layer l (partition.spec.models.layer_param_counts)                     [-]
  R    = tflops(dtype) * 1e12 * mfu: sustained rate of the device in the run's dtype   [FLOP/s]
       (partition.spec.hardware.DeviceSpec.tflops: the fp16/bf16 tensor rate, or fp32's on CUDA cores)

Per layer l (names "embedding", "block", "head"):
  param_bytes       n_l * e
  fwd_flops         block      2*b*s*m + 4*b*s^2*h         (the matmuls with m weights, two FLOPs per
                                                            multiply-add, plus QK^T and AV;
                                                            Narayanan et al. 2021, Megatron-LM, FLOP count;
                                                            gpt at f = 4h: 2*b*s*12h^2 + 4*b*s^2*h)
                    embedding  2*b*s*h                     (a token charge: one gather and one add per
                                                            output element, so the layer is not free)
                    head       2*b*s*h*V                   (the logits matmul)
  bwd_flops         2 * fwd_flops                          (input and weight gradients, same matmuls)
  fwd_s, bwd_s      fwd_flops / R + c, bwd_flops / R         (c: the device's forward_call_s, each layer
                                                            forward's fixed cost, 0 on a GPU)
  activation_bytes  what the layer's training forward keeps for backward, counted tensor by tensor as torch's
                    autograd saves them (checked with saved-tensor hooks against the built-in GPT and transformers'
                    GPT-2, Llama, Mistral and Qwen2 layers, tests/mobiuspipe/models/test_hf_activations.py); t = s*b
                    tokens, p = the activation's kept tensors (partition.spec.models.ACTIVATIONS: 1 for torch's
                    gelu and silu, 4 for GPT-2's gelu_new), m = a dropout mask's bytes an element (DeviceSpec.
                    mask_bytes: 1 on a GPU, whose fused dropout keeps a bool; e on the CPU stand-in, which keeps
                    the dropout's noise in the dtype)
                    block gpt   t*(2*N + A + e*f*(p + 1) + D) + L
                    block llama t*(2*N + A + e*f*(p + 3)) + L + 2*e*hd*s
                      N  a norm, per token: LayerNorm  2*e*h + 8   (its input, its output (the next matmul's input),
                                                                    fp32 mean and 1/std)
                                            RMSNorm    4*h + 2*e*h + 4  (transformers' LlamaRMSNorm: an fp32 copy of its
                                                                    input (the input itself in fp32), the normalized
                                                                    values cast back, its output, fp32 1/rms)
                      A  attention, per token, fused (flash, memory-efficient):  e*(2h + 2c)  (Q, K and V, the output
                                                                    (the projection's input, a view of it)); c = k*h/a,
                                                                    or h in fp32 with grouped queries (the layers
                                                                    repeat K and V then: CUDA's kernels that take fp32
                                                                    refuse grouped queries); the log-sum-exp L =
                                                                    4*a*b*ceil(s/32)*32 (fp32, rows padded to 32 by the
                                                                    memory-efficient kernel), in place of Korthikanti
                                                                    et al. 2022's 5as^2b of scores, softmax and mask;
                                                                    in half precision on a gpu (fused_dropout) also
                                                                    R = RNG_STATE_BYTES (the random state's seed and
                                                                    offset, dropout or not)
                         with dropout on a device with no fused kernel for it (the CPU stand-in): the math kernel,
                                            4*3h + e*h per token (Q, K and V in fp32, the output's copy) and
                                            L = 3 * 4*a*s^2*b (fp32 probabilities, their mask and the dropped ones)
                      the MLP: gpt its input (the first norm's output is counted in N), the activation's p tensors and
                         the second matmul's input; llama (SwiGLU) the gate's p, the gate's activation, the up
                         projection, their product (down's input)
                      D  gpt residual dropout: 2*m*h (two masks); 0 without it
                      2*e*hd*s  llama: the rotary cos and sin tables of the microbatch's positions
                    embedding  gpt    8*s*(b + 1) + t*m*h*[embedding dropout]  (the int64 token ids and positions,
                                                                    which its gathers keep; the dropout's mask; the
                                                                    summed embeddings are its output, which the first
                                                                    block keeps)
                               llama  8*s*b                          (the ids)
                    head       t*(N + 4*V + 8) + 4                   (the final norm; the fp32 log-softmax of the loss,
                                                                    which the runtime computes on fp32 logits; the
                                                                    int64 targets; the loss's fp32 total weight)
  output_bytes      embedding, block  s*b*h*e ;  head  s*b*V*e
Per microbatch: input_bytes and target_bytes 8*s*b (int64 token ids).

With LoRA (a_l adapter parameters of layer l: partition.spec.lora.adapter_counts), the base's n_l parameters are
frozen: param_count n_l + a_l, trainable_count a_l, param_bytes (n_l + a_l) * e; fwd_flops gains 2*b*s*a_l (the
adapters' matmuls); the backward computes no weight gradient of the base, only its input gradient, so
bwd_flops = (fwd_flops without the adapters) + 2 * 2*b*s*a_l (the adapters' input and weight gradients);
activation_bytes gains s*b*k_l (partition.spec.lora.adapter_kept: what the adapters keep, A's outputs and with
dropout the dropped inputs and their masks, less what a frozen base does not keep: the inputs of its linear layers
that no adapter or other op keeps, its RMSNorms' normalized values); the embedding, frozen, keeps nothing.
With the base quantized (`frozen`: partition.spec.lora.frozen_layers), its items and bytes are those of the codes and
scales (about 1 byte per weight of each linear layer in int8, 0.52 in NF4); its FLOPs are unchanged (the
dequantized weight computes as the dense one; the dequantization's own work is left out); workspace_bytes (X_l) is
what dequantizing the layer's largest weight allocates (q_l: partition.spec.lora.dequantized_bytes, the weight in the
dtype and NF4's chunk of temporaries).
On a device whose memory holds transients (DeviceSpec.holds_transients: a gpu; not the CPU stand-in, whose ledger counts
none), workspace_bytes (X_l) is what the layer's backward allocates beyond what its forward kept, at its most (the
gradients of its intermediates and of its input, a weight's gradient before it is added into the gradient slot);
r = 1 if the layer's weights train, 0 where they are frozen (LoRA's base); x_l = q_l + e*a_l with LoRA (what lives
beside a linear's gradients: the dequantized weight, the adapters' gradients), else 0; over the layer's linear layers
(in_L -> out_L: partition.spec.lora.block_linears):
  embedding  r*e*(max(V*h, s*h + P*h) + d*t*h)              (the token table's dense gradient, or before it a gpt's
                                                              position gradient summed over the microbatch and the
                                                              position table's; P its rows, a llama none; d = 1
                                                              with embedding dropout: its input's gradient, alive
                                                              beside them where the mask is a bool)
             + r*(4*h + 64)*t where t > 3072                (CUDA's kernel past 3,072 ids sorts them and sums each
                                                              run of equal ids in fp32 first: torch's
                                                              embedding_dense_backward_cuda, read, not measured)
  block      max( e*(max_L (t*in_L + r*in_L*out_L + out_L)  (a linear's input and weight gradients and its bias's,
                     + d*t*h) + x_l,                          at the widest input: the MLP's down projection; d = 1
                                                              with residual dropout: its output's gradient)
                  e*g*t*f,                                  (the MLP's activation backward: g = 1 for a gpt whose
                                                              activation keeps its input alone (torch's gelu: the
                                                              down projection's kept input, freed by then, makes
                                                              room), 2 for relu (its kept output is that input),
                                                              gpt2's gelu_new (a chain of elementwise ops) and a
                                                              llama's SwiGLU; one more when frozen (a frozen down
                                                              projection keeps no input to free), but for a gpt's
                                                              relu)
                  N'(K) )                                   (a norm's backward, net of K, the kept bytes let go
                                                              before it: a gpt's LayerNorm 2*e*t*h - K; transformers'
                                                              RMSNorm, a chain of fp32 ops, (20 - 2*e*r)*t*h - K,
                                                              measured op by op; a block's K: a llama's MLP's kept
                                                              e*t*f*(p + 2 + r), a gpt's 0)
             + e*t*f with adapters                         (an adapted block's forward: its own transients, which
                                                              the allocator's peak over a recompute sees, measured
                                                              up to 1.10x the rest with adapters on q and down)
  head       max( 8*t*V, e*(t*h + r*h*V) + x_l, N'(4*t*V) ) (the loss's two fp32 t x V gradients, of log-softmax's
                                                              output and input; then the logits' input and weight
                                                              gradients, the kept log-softmax freed; then the final
                                                              norm, the log-softmax freed)
checked tensor by tensor against the built-in GPT and transformers' GPT-2 (its dropouts with CUDA's bool masks),
Llama and Qwen2 layers, trained, frozen and with adapters (tests/mobiuspipe/profiling/test_transients.py: every op's
outputs alive at once on the CPU; a forward's own transients only with adapters, and with an MLP 2.7 times the
width or wider: transformers' RMSNorm computes its forward in fp32 too, which a narrower MLP's backward does not
cover). What a CUDA kernel allocates inside itself is not seen there: flash attention's
fp32 gradient accumulator comes once the MLP's kept tensors, more than it, are freed; attention's dropout runs inside
CUDA's fused kernels (the CPU's math kernel for it keeps s x s tensors a gpu does not). Profile.library_bytes (W) is
the device's DeviceSpec.library_bytes. Elsewhere X_l is q_l alone, and W = 0.
LayerNorm, RMSNorm, SiLU/GELU and bias FLOPs are left out (under 1% of a block for h >= 512). mobiuspipe runs every
model's attention through SDPA (the built-in GPT, and the Hugging Face layers through mobiuspipe.models.hf's
attention function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from partition.spec.hardware import MFU_DEFAULT, DeviceSpec
from partition.spec.lora import FrozenBase, block_linears
from partition.spec.models import ACTIVATIONS, ModelSpec, block_matmul_params, layer_param_counts
from partition.spec.profile import LayerProfile, Profile

__all__ = ["DTYPE_BYTES", "analytic_profile", "dtype_bytes"]

TOKEN_BYTES = 8
"""Bytes of one token id of the input and of the targets (int64, as the data loaders give them)."""
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
"""e of the legend for each accepted dtype."""


def dtype_bytes(dtype: str) -> int:
    """e for `dtype`; ValueError naming the accepted dtypes otherwise."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _check_args(microbatch_size: int, mfu: float) -> None:
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size <= 0:
        raise ValueError(f"microbatch_size must be a positive integer, found {microbatch_size!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], found {mfu!r}; {MFU_DEFAULT} is the documented default")


def _layer(name: str, n: int, e: int, act: int, out: int, fwd_flops: float, rate: float, call_s: float) -> LayerProfile:
    bwd_flops = 2.0 * fwd_flops
    return LayerProfile(
        name=name,
        param_count=n,
        param_bytes=n * e,
        activation_bytes=act,
        output_bytes=out,
        fwd_flops=fwd_flops,
        bwd_flops=bwd_flops,
        fwd_s=fwd_flops / rate + call_s,
        bwd_s=bwd_flops / rate,
    )


LSE_ALIGN = 32
"""The memory-efficient kernel pads each row of its log-sum-exp to a multiple of this many positions (torch's
kAlignLSE)."""


RNG_STATE_BYTES = 24
"""R of the legend: what SDPA's half-precision kernels on a gpu keep of the random generator's state for backward,
dropout or not, as the seed and offset they return: torch's flash kernel a two-element uint64 state and an unused
uint64 scalar on the gpu (24 bytes; gpu_check's HF rows on an H200, torch 2.11: bf16 GPT-2 and Llama blocks kept
1.000003 and 1.000004 of a count without it, 19-27 and 20-25 bytes), cuDNN's two one-element int64 tensors (16). fp32's
memory-efficient kernel keeps them on the host."""


def _norm_bytes(spec: ModelSpec, e: int) -> int:
    """N of the legend: what a norm keeps per token."""
    h = spec.d_model
    return 4 * h + 2 * e * h + 4 if spec.family == "llama" else 2 * e * h + 8


def _attention_bytes(spec: ModelSpec, e: int, s: int, b: int, fused_dropout: bool) -> int:
    """A's tokens' share and L of the legend for one microbatch."""
    h, a = spec.d_model, spec.num_heads
    if spec.attn_dropout > 0 and not fused_dropout:
        return s * b * (4 * 3 * h + e * h) + 3 * 4 * a * s * s * b
    grouped = spec.kv_heads < spec.num_heads
    c = h if grouped and e == 4 else spec.kv_heads * spec.head_dim
    rng = RNG_STATE_BYTES if fused_dropout and e == 2 else 0
    return s * b * e * (2 * h + 2 * c) + 4 * a * b * -(-s // LSE_ALIGN) * LSE_ALIGN + rng


def _block_act(spec: ModelSpec, e: int, s: int, b: int, device: DeviceSpec) -> int:
    """A block's activation_bytes for one microbatch (the legend)."""
    h, f, p, m = spec.d_model, spec.ffn, ACTIVATIONS[spec.act], device.mask_bytes(e)
    kept = 2 * _norm_bytes(spec, e)
    if spec.family == "llama":
        kept += e * f * (p + 3)
        rope = 2 * e * spec.head_dim * s
    else:
        kept += e * f * (p + 1) + (2 * m * h if spec.resid_dropout > 0 else 0)
        rope = 0
    return s * b * kept + _attention_bytes(spec, e, s, b, device.fused_dropout) + rope


def _embedding_act(spec: ModelSpec, e: int, s: int, b: int, m: int) -> int:
    """The embedding's activation_bytes for one microbatch (the legend; m: a dropout mask's bytes an element)."""
    if spec.family == "llama":
        return TOKEN_BYTES * s * b
    return TOKEN_BYTES * s * (b + 1) + (s * b * m * spec.d_model if spec.embd_dropout > 0 else 0)


SORTED_IDS = 3072
"""Past this many ids a microbatch's embedding gradient takes CUDA's sorted path (torch's Embedding.cu)."""


def _norm_transients(spec: ModelSpec, e: int, t: int, r: int, freed: int) -> int:
    """N' of the legend: what a norm's backward holds at once for t tokens, net of `freed`, the kept bytes let go
    before it."""
    h = spec.d_model
    if spec.family == "llama":
        return 20 * t * h - 2 * e * r * t * h - freed
    return 2 * e * t * h - freed


def _block_transients(spec: ModelSpec, e: int, t: int, r: int, extra: int) -> int:
    """A block's X_l for t tokens, its weights trained (r = 1) or frozen, `extra` bytes beside a linear's gradients
    (the legend)."""
    out = t * spec.d_model if spec.resid_dropout > 0 else 0
    linear = max(t * x.in_features + r * x.in_features * x.out_features + x.out_features for x in block_linears(spec))
    p = ACTIVATIONS[spec.act]
    g = (1 if spec.family == "gpt" and p == 1 else 2) + (1 - r if p > 0 or spec.family == "llama" else 0)
    mlp = e * t * spec.ffn * (p + 2 + r) if spec.family == "llama" else 0
    return max(e * (linear + out) + extra, e * g * t * spec.ffn, _norm_transients(spec, e, t, r, mlp))


def _layer_transients(spec: ModelSpec, e: int, t: int, l: int, trains: bool, extra: int) -> int:
    """X_l of layer l (embedding, block or head) for t tokens, its weights trained or frozen, `extra` bytes beside
    a linear's gradients (a quantized base's dequantized weight, the adapters' gradients; the legend)."""
    h, v, r = spec.d_model, spec.vocab_size, 1 if trains else 0
    if l == 0:
        positions = 0 if spec.family == "llama" else spec.seq_len * h + (spec.positions or spec.seq_len) * h
        dropout = t * h if spec.embd_dropout > 0 else 0
        return r * (e * (max(v * h, positions) + dropout) + ((4 * h + 64) * t if t > SORTED_IDS else 0))
    if l < spec.num_layers - 1:
        return _block_transients(spec, e, t, r, extra)
    return max(8 * t * v, e * (t * h + r * h * v) + extra, _norm_transients(spec, e, t, r, 4 * t * v))


def _with_adapters(
    x: LayerProfile, a: int, kept: int, e: int, tokens: int, rate: float, call_s: float, base: tuple[int, int, int]
) -> LayerProfile:
    """Layer x with a adapter parameters beside its frozen ones, keeping `kept` bytes a token (the legend's LoRA
    paragraph), the frozen ones kept as `base` says (items, bytes, X_l); tokens = b*s."""
    adapter_flops = float(2 * tokens * a)
    fwd, bwd = x.fwd_flops + adapter_flops, x.fwd_flops + 2 * adapter_flops
    items, nbytes, dequantized = base
    return replace(
        x,
        param_count=items + a,
        param_bytes=nbytes + a * e,
        trainable_count=a,
        activation_bytes=x.activation_bytes + tokens * kept,
        workspace_bytes=dequantized,
        fwd_flops=fwd,
        bwd_flops=bwd,
        fwd_s=fwd / rate + call_s,
        bwd_s=bwd / rate,
    )


def _with_transients(spec: ModelSpec, e: int, t: int, l: int, x: LayerProfile, trains: bool) -> LayerProfile:
    """Layer l with its X_l on a device that holds transients (the legend): beside a linear's gradients, what x
    already counts (a quantized base's dequantized weight) and its adapters' gradients; an adapted block's forward
    one tensor of the MLP's width more."""
    adapters = 0 if trains else x.trainable_count or 0
    count = _layer_transients(spec, e, t, l, trains, x.workspace_bytes + e * adapters)
    adapted_block = adapters and 0 < l < spec.num_layers - 1
    return replace(x, workspace_bytes=count + (e * t * spec.ffn if adapted_block else 0))


def analytic_profile(
    spec: ModelSpec,
    device: DeviceSpec,
    microbatch_size: int = 1,
    dtype: str = "fp16",
    mfu: float = MFU_DEFAULT,
    adapters: Sequence[int] | None = None,
    frozen: FrozenBase | None = None,
    adapter_kept: Sequence[int] | None = None,
) -> Profile:
    """Profile of `spec` on `device` for microbatches of `microbatch_size` sequences (see the legend); with
    `adapters` (a_l of every layer), of the model with those LoRA adapters, its base frozen, kept as `frozen`
    says (items and bytes per layer: an int8 or NF4 base) or in the dtype, the adapters keeping `adapter_kept`
    bytes a token (k_l of every layer; None: 0)."""
    e = dtype_bytes(dtype)
    _check_args(microbatch_size, mfu)
    s, b, h, v = spec.seq_len, microbatch_size, spec.d_model, spec.vocab_size
    rate = device.tflops(dtype) * 1e12 * mfu
    counts = layer_param_counts(spec)
    hidden = s * b * h * e
    block_act = _block_act(spec, e, s, b, device)
    block_flops = float(2 * b * s * block_matmul_params(spec) + 4 * b * s * s * h)
    c = device.forward_call_s
    embedding_act = _embedding_act(spec, e, s, b, device.mask_bytes(e))
    embedding = _layer("embedding", counts[0], e, embedding_act, hidden, float(2 * b * s * h), rate, c)
    blocks = [_layer("block", n, e, block_act, hidden, block_flops, rate, c) for n in counts[1:-1]]
    head_act = s * b * (_norm_bytes(spec, e) + 4 * v + TOKEN_BYTES) + 4
    head = _layer("head", counts[-1], e, head_act, s * b * v * e, float(2 * b * s * h * v), rate, c)
    layers = (embedding, *blocks, head)
    if adapters is not None:
        if len(adapters) != len(layers):
            raise ValueError(f"adapters: expected a count for each of the {len(layers)} layers, found {len(adapters)}")
        dense = [(x.param_count, x.param_count * e, 0) for x in layers]
        bases = list(zip(frozen.items, frozen.nbytes, frozen.dequantized)) if frozen is not None else dense
        kept = adapter_kept if adapter_kept is not None else [0] * len(layers)
        if len(kept) != len(layers):
            raise ValueError(f"adapter_kept: expected a count for each of the {len(layers)} layers, found {len(kept)}")
        layers = tuple(
            _with_adapters(x, a, k, e, s * b, rate, c, z) for x, a, k, z in zip(layers, adapters, kept, bases)
        )
        layers = (replace(layers[0], activation_bytes=0), *layers[1:])  # a frozen embedding
    if device.holds_transients:
        layers = tuple(_with_transients(spec, e, s * b, l, x, adapters is None) for l, x in enumerate(layers))
    return Profile(
        model=spec.name,
        device=device.name,
        dtype=dtype,
        microbatch_size=b,
        seq_len=s,
        layers=layers,
        input_bytes=TOKEN_BYTES * s * b,
        target_bytes=TOKEN_BYTES * s * b,
        library_bytes=device.library_bytes,
    )
