"""LoRA in the plan: which linear layers of a spec an adapter targets, and the parameters its adapters add.

Legend (per layer l; units in brackets):
  r      the adapters' rank (LoraShape.rank)                                                [-]
  i, o   a target linear layer's input and output features                                  [-]
  a_l    adapter parameters of layer l: r (i + o) for each target linear layer of it
         (A is r x i, B is o x r; no biases)                                                 [-]
  n_l    the layer's own parameters (partition.spec.models.layer_param_counts): frozen     [-]
  e      bytes per element of the training dtype                                            [bytes]
  k_l    bytes a token LoRA changes in what layer l keeps for backward from the count of a trained layer
         (partition.spec.analytic; negative: less) [bytes]:
           + for each target r * e (A's output, which B keeps) and, with dropout, (e + m) * i (the dropped input,
             which A keeps, and the dropout's mask of m bytes an element: 1 on a GPU, e on the CPU stand-in;
             partition.spec.hardware.DeviceSpec.mask_bytes)
           - e * i for each input of the layer's linear layers that nothing keeps once the base is frozen: a
             frozen linear keeps no input (autograd saves it for the weight's gradient), an adapter keeps it where
             it has no dropout, another op where it reads it too (LinearInput.kept_anyway)
           - e * h for each RMSNorm (llama: two a block, one in the head): a frozen one keeps no normalized values
         (The frozen embedding keeps nothing: the analytic profile's LoRA paragraph.)
A frozen base kept quantized (BASE_DTYPES) keeps a linear weight of i x o values as:
  nf4    (where 16,384 divides i o) codes i o / 2, one int8 scale per 64 values, one bf16 factor per 256 scales,
         one bf16 mean: about 0.52 bytes per weight (nf4_numel, nf4_bytes)
  int8   the values i o, one fp32 scale per output feature: i o + 4 o bytes (int8_numel, int8_bytes)

A target names linear layers as PEFT's `target_modules` does: a layer whose dotted name is the target or ends
with "." and the target. The names are Hugging Face's: a "gpt" block has GPT-2's attn.c_attn, attn.c_proj,
mlp.c_fc and mlp.c_proj, a "llama" block self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj, and the head
lm_head. Embeddings and norms take no adapter. (mobiuspipe's built-in GPT names its layers otherwise: a run
counts its adapters on the layers themselves and gives the counts to analytic_profile.)
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.spec.models import ModelSpec, layer_param_counts

__all__ = [
    "LoraShape",
    "Linear",
    "block_linears",
    "head_linears",
    "adapter_counts",
    "adapter_kept",
    "kept_per_token",
    "LinearInput",
    "block_inputs",
    "target_names",
    "default_targets",
    "BASE_DTYPES",
    "NF4_BLOCK",
    "NF4_SCALER_BLOCK",
    "nf4_quantizable",
    "DEQUANT_CHUNK",
    "dequantized_bytes",
    "nf4_numel",
    "nf4_bytes",
    "int8_numel",
    "int8_bytes",
    "FrozenBase",
    "frozen_layers",
]

BASE_DTYPES = ("int8", "nf4")
"""The forms a LoRA run's frozen base can be kept in besides the training dtype (the legend)."""
NF4_BLOCK = 64
"""Weights per NF4 block (one absmax scale each): QLoRA's 64 (torchao's default)."""
NF4_SCALER_BLOCK = 256
"""Scales per block of NF4's second quantization (one factor each): QLoRA's 256."""
DEQUANT_CHUNK = 1 << 20
"""NF4 weights dequantized at a time (mobiuspipe.lora.quant.dequantize; a multiple of NF4_BLOCK)."""


def nf4_quantizable(numel: int) -> bool:
    """Whether an NF4 weight of `numel` values exists: torchao's blocks divide it."""
    return numel % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0


def nf4_numel(numel: int) -> int:
    """Items an NF4 weight of `numel` values is kept as: its codes (two per byte), its int8 scales, its
    second-level factors and its mean (mobiuspipe.lora.quant.NF4Linear's parameters)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + blocks // NF4_SCALER_BLOCK + 1


def nf4_bytes(numel: int) -> int:
    """Bytes of an NF4 weight of `numel` values: codes and scales one byte each, factors and mean two (bf16)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + 2 * (blocks // NF4_SCALER_BLOCK) + 2


def int8_numel(in_features: int, out_features: int) -> int:
    """Items an int8 weight is kept as: its values and a scale per output feature (mobiuspipe.lora.quant.Int8Linear's
    parameters)."""
    return in_features * out_features + out_features


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of an int8 weight: a byte per value and 4 per output feature's scale (float32)."""
    return in_features * out_features + 4 * out_features


def dequantized_bytes(numel: int, e: int, base_dtype: str) -> int:
    """Bytes dequantizing a frozen weight of `numel` values kept in `base_dtype` allocates, its result in a dtype of
    e bytes included (mobiuspipe.lora.quant; each forward, recompute and backward of its layer does it): int8 the
    weight alone (converted, then scaled in place); NF4 the weight, its blocks' scales (numel / 64 bfloat16 values,
    twice while they are made) and a chunk's int32 code indices and looked-up values (4 bytes a weight of at most
    DEQUANT_CHUNK)."""
    if base_dtype == "int8":
        return e * numel
    return e * numel + 2 * 2 * (numel // NF4_BLOCK) + 4 * min(numel, DEQUANT_CHUNK)


def _kept(lin: Linear, base_dtype: str) -> tuple[int, int] | None:
    """(items, bytes) of a frozen linear weight kept in `base_dtype`; None where that form does not take it."""
    n = lin.in_features * lin.out_features
    if base_dtype == "int8":
        return int8_numel(lin.in_features, lin.out_features), int8_bytes(lin.in_features, lin.out_features)
    return (nf4_numel(n), nf4_bytes(n)) if nf4_quantizable(n) else None


@dataclass(frozen=True)
class LoraShape:
    """What the planner needs of a LoRA adapter: its rank, target module names and dropout probability."""

    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank: expected an integer >= 1, found {self.rank!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoRA targets: expected module names such as q_proj or c_attn, found {self.targets!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout: expected a probability in [0, 1), found {self.dropout!r}")
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))


@dataclass(frozen=True)
class Linear:
    """A linear layer of a layer: its dotted name in the layer (see the module docstring), i and o."""

    name: str
    in_features: int
    out_features: int

    def targeted_by(self, targets: tuple[str, ...]) -> bool:
        """Whether a target names it, by PEFT's rule."""
        return any(self.name == t or self.name.endswith(f".{t}") for t in targets)


def block_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The linear layers of one block of `spec`."""
    d, f = spec.d_model, spec.ffn
    if spec.family == "llama":
        kv = spec.kv_heads * spec.head_dim
        attn = [("q_proj", d, d), ("k_proj", d, kv), ("v_proj", d, kv), ("o_proj", d, d)]
        mlp = [("gate_proj", d, f), ("up_proj", d, f), ("down_proj", f, d)]
        return tuple(Linear(f"self_attn.{n}", i, o) for n, i, o in attn) + tuple(
            Linear(f"mlp.{n}", i, o) for n, i, o in mlp
        )
    return (
        Linear("attn.c_attn", d, 3 * d),
        Linear("attn.c_proj", d, d),
        Linear("mlp.c_fc", d, f),
        Linear("mlp.c_proj", f, d),
    )


def head_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The head's linear layer (the logits): d -> V."""
    return (Linear("lm_head", spec.d_model, spec.vocab_size),)


def default_targets(spec: ModelSpec) -> tuple[str, ...]:
    """PEFT's default targets for a model of this family (its target_modules when none are given): the query
    and value projections of a llama, the fused qkv projection of a gpt."""
    return ("q_proj", "v_proj") if spec.family == "llama" else ("c_attn",)


def target_names(spec: ModelSpec) -> list[str]:
    """Every name a target may match in `spec`, block layers first (for a message naming what there is)."""
    return [lin.name for lin in (*block_linears(spec), *head_linears(spec))]


def adapter_counts(spec: ModelSpec, lora: LoraShape) -> list[int]:
    """a_l of the legend for every layer of `spec`, embedding first; ValueError when a target names no linear
    layer of the model (a typo would otherwise plan, and train, nothing under that name)."""
    linears = (*block_linears(spec), *head_linears(spec))
    unknown = [t for t in lora.targets if not any(lin.targeted_by((t,)) for lin in linears)]
    if unknown:
        raise ValueError(
            f"LoRA targets {', '.join(unknown)} name no linear layer of {spec.name}; its linear layers are "
            f"{', '.join(target_names(spec))}"
        )

    def count(lins: tuple[Linear, ...]) -> int:
        return sum(lora.rank * (x.in_features + x.out_features) for x in lins if x.targeted_by(lora.targets))

    return [0] + [count(block_linears(spec))] * spec.num_blocks + [count(head_linears(spec))]


def kept_per_token(rank: int, in_features: int, dropout: float, e: int, m: int) -> int:
    """Bytes a token one adapter keeps for backward (k_l's term for one target of the legend; m: a dropout mask's
    bytes an element)."""
    return rank * e + ((e + m) * in_features if dropout > 0 else 0)


@dataclass(frozen=True)
class LinearInput:
    """An input of a layer's linear layers: its width, the linear layers that read it (names as Linear's) and
    whether another op of the layer keeps it anyway (attention's output, which SDPA keeps; relu's output)."""

    width: int
    readers: tuple[str, ...]
    kept_anyway: bool = False


def block_inputs(spec: ModelSpec) -> tuple[LinearInput, ...]:
    """The inputs of a block's linear layers (see LinearInput)."""
    h, f = spec.d_model, spec.ffn
    if spec.family == "llama":
        return (
            LinearInput(h, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            LinearInput(h, ("self_attn.o_proj",), kept_anyway=True),
            LinearInput(h, ("mlp.gate_proj", "mlp.up_proj")),
            LinearInput(f, ("mlp.down_proj",)),
        )
    return (
        LinearInput(h, ("attn.c_attn",)),
        LinearInput(h, ("attn.c_proj",), kept_anyway=True),
        LinearInput(h, ("mlp.c_fc",)),
        LinearInput(f, ("mlp.c_proj",), kept_anyway=spec.act == "relu"),
    )


def adapter_kept(spec: ModelSpec, lora: LoraShape, e: int, m: int) -> list[int]:
    """k_l of the legend for every layer of `spec`, embedding first (its targets checked by adapter_counts), in a dtype
    of e bytes on a device whose dropout masks take m bytes an element (DeviceSpec.mask_bytes(e))."""
    rms = spec.family == "llama"

    def kept(lins: tuple[Linear, ...], inputs: tuple[LinearInput, ...], norms: int) -> int:
        targets = {x.name for x in lins if x.targeted_by(lora.targets)}
        adds = sum(kept_per_token(lora.rank, x.in_features, lora.dropout, e, m) for x in lins if x.name in targets)
        by_adapter = lora.dropout == 0  # an adapter with dropout keeps its own dropped copy, not the input
        dropped = [i for i in inputs if not i.kept_anyway and not (by_adapter and targets & set(i.readers))]
        return adds - e * sum(i.width for i in dropped) - norms * e * spec.d_model

    head = (LinearInput(spec.d_model, ("lm_head",)),)
    block = kept(block_linears(spec), block_inputs(spec), 2 if rms else 0)
    return [0] + [block] * spec.num_blocks + [kept(head_linears(spec), head, 1 if rms else 0)]


@dataclass(frozen=True)
class FrozenBase:
    """How a LoRA run with a quantized base keeps each layer's frozen weights (embedding first; adapters left
    out)."""

    items: tuple[int, ...]
    """Items of each layer: the quantized weights' codes and scales, the rest (biases, norms, embeddings) one each."""
    nbytes: tuple[int, ...]
    """Bytes of each layer, the rest in the training dtype."""
    dequantized: tuple[int, ...]
    """What dequantizing the layer's largest quantized weight allocates while the layer computes (dequantized_bytes;
    0 where none is quantized): its X_l (partition.spec.profile)."""


def frozen_layers(spec: ModelSpec, dtype_bytes: int, base_dtype: str = "nf4") -> FrozenBase:
    """Each layer of `spec` with its block and head linear weights in `base_dtype` (one of BASE_DTYPES) where that
    form takes them (the rest, biases, norms and embeddings in the dtype of `dtype_bytes`), adapters left out: the
    frozen base as a LoRA run with that base_dtype keeps it."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype: expected one of {', '.join(BASE_DTYPES)}, found {base_dtype!r}")

    def shrink(lins: tuple[Linear, ...]) -> tuple[int, int, int]:
        items = bytes_ = most = 0
        for x in lins:
            n, kept = x.in_features * x.out_features, _kept(x, base_dtype)
            if kept is not None:
                items, bytes_ = items + n - kept[0], bytes_ + n * dtype_bytes - kept[1]
                most = max(most, dequantized_bytes(n, dtype_bytes, base_dtype))
        return items, bytes_, most

    counts = layer_param_counts(spec)
    block, head = shrink(block_linears(spec)), shrink(head_linears(spec))
    less = [(0, 0, 0)] + [block] * spec.num_blocks + [head]
    return FrozenBase(
        items=tuple(n - i for n, (i, _, _) in zip(counts, less)),
        nbytes=tuple(n * dtype_bytes - b for n, (_, b, _) in zip(counts, less)),
        dequantized=tuple(x for _, _, x in less),
    )
