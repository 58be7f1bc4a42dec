"""Model specs: the shape of a GPT or LLaMA, its layers and their parameter counts, and the model table.

Layers of a spec with L blocks (V = vocab_size, T = seq_len, d = d_model, f = ffn (MLP width),
a = num_heads, k = kv_heads, hd = d / a). A "gpt" spec must match the PyTorch GPT the runtime builds
(mobiuspipe.models.gpt), parameter for parameter:

family "gpt" (biases everywhere, LayerNorm, GELU MLP, learned positions, untied head; f = 4d by default;
P = positions, the position table's rows, T by default; GPT-2's n_positions)
  layer 0        embedding  token table V x d + position table P x d, no bias        V*d + P*d
  layers 1..L    block      LayerNorm(d) 2d + Linear(d,3d) 3d^2+3d + Linear(d,d) d^2+d
                            + LayerNorm(d) 2d + Linear(d,f) d*f+f + Linear(f,d) f*d+d  4d^2 + 2df + f + 9d
                                                                       (f = 4d: 12d^2 + 13d)
  layer L+1      head       LayerNorm(d) 2d + Linear(d,V, bias=False) V*d (untied)      V*d + 2d

family "llama" (no biases, RMSNorm, SwiGLU MLP, rotary positions (no table), grouped-query attention)
  layer 0        embedding  token table V x d                                          V*d
  layers 1..L    block      RMSNorm d + q d*d + k d*(k*hd) + v d*(k*hd) + o d*d
                            + RMSNorm d + gate d*f + up d*f + down f*d                 2d^2 + 2d*k*hd + 3df + 2d
                            (qkv_bias, Qwen2: + q/k/v biases d + 2*k*hd)
  layer L+1      head       RMSNorm d + Linear(d,V, bias=False) V*d (untied)           V*d + d
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType

__all__ = ["ACTIVATIONS", "FAMILIES", "MODELS", "ModelSpec", "layer_param_counts", "block_matmul_params"]

FAMILIES = ("gpt", "llama")
"""Layer structures a spec can have (see the module docstring)."""
DEFAULT_ACTIVATION = MappingProxyType({"gpt": "gelu", "llama": "silu"})
"""The MLP activation of a spec whose `activation` is "" (the built-in GPT's torch gelu; a llama's SwiGLU gate)."""
ACTIVATIONS = MappingProxyType({"gelu": 1, "gelu_pytorch_tanh": 1, "gelu_new": 4, "relu": 0, "silu": 1, "swish": 1})
"""MLP activations a spec accepts, by transformers' names (ACT2FN) -> the tensors of the MLP's width each keeps for
backward beside its output: torch's gelu (exact or tanh) and silu their input, relu none (its output, which the next
matmul keeps); transformers' gelu_new, its tanh formula written in Python (GPT-2's default): its input, the tanh,
half the input and 1 + the tanh."""

_POSITIVE = ("num_blocks", "d_model", "num_heads", "seq_len", "vocab_size")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer: blocks, widths and the sequence it is trained on."""

    name: str
    num_blocks: int
    """Transformer blocks (L); the model has L + 2 layers."""
    d_model: int
    """Hidden size h (d)."""
    num_heads: int
    """Attention (query) heads a; d_model must be a multiple of it."""
    seq_len: int
    """Tokens per sequence s (T); for "gpt" also the size of the position table unless `positions` says."""
    vocab_size: int
    """Vocabulary size V."""
    family: str = "gpt"
    """Layer structure: "gpt" or "llama" (see the module docstring)."""
    ffn_dim: int = 0
    """MLP width f; 0 means 4 * d_model (gpt only: a llama spec must give it)."""
    num_kv_heads: int = 0
    """Key/value heads k (grouped-query attention, llama only); 0 means num_heads."""
    positions: int = 0
    """Rows of the position table P ("gpt" only; GPT-2's n_positions); 0 means seq_len."""
    qkv_bias: bool = False
    """The q, k and v projections have biases ("llama" only: Qwen2)."""
    activation: str = ""
    """The MLP's activation, one of ACTIVATIONS (GPT-2's activation_function; a llama's hidden_act, its SwiGLU
    gate); "" means the family's (DEFAULT_ACTIVATION)."""
    embd_dropout: float = 0.0
    """Probability of the dropout after the embedding ("gpt" only: GPT-2's embd_pdrop; the built-in GPT has none)."""
    resid_dropout: float = 0.0
    """Probability of the dropouts on a block's two residual branches ("gpt" only: GPT-2's resid_pdrop)."""
    attn_dropout: float = 0.0
    """Probability of the dropout on the attention probabilities (GPT-2's attn_pdrop, a llama's attention_dropout)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, found {self.name!r}")
        for f in _POSITIVE:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, found {v!r}")
        for f in ("ffn_dim", "num_kv_heads", "positions"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"model {self.name!r}: {f} must be an integer >= 0 (0 = the default), found {v!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family must be one of {', '.join(FAMILIES)}, found {self.family!r}")
        self._check_training()
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: d_model {self.d_model} is not a multiple of num_heads {self.num_heads} "
                f"({self.d_model} / {self.num_heads} = {self.d_model / self.num_heads:.3f}); "
                f"pick a head count that divides d_model"
            )
        self._check_family()

    def _check_training(self) -> None:
        if self.activation and self.activation not in ACTIVATIONS:
            raise ValueError(
                f"model {self.name!r}: activation {self.activation!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)} (transformers' names), or \"\" for the family's"
            )
        for f in ("embd_dropout", "resid_dropout", "attn_dropout"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
                raise ValueError(f"model {self.name!r}: {f} must be a probability in [0, 1), found {v!r}")
        if self.family == "llama" and (self.embd_dropout or self.resid_dropout):
            raise ValueError(
                f"model {self.name!r}: a llama block has no embedding or residual dropout; embd_dropout and "
                f"resid_dropout must be 0, found {self.embd_dropout} and {self.resid_dropout}"
            )

    def _check_family(self) -> None:
        if self.family == "gpt" and self.num_kv_heads not in (0, self.num_heads):
            raise ValueError(
                f"model {self.name!r}: a gpt block has no grouped-query attention; num_kv_heads must "
                f"be 0 or num_heads ({self.num_heads}), found {self.num_kv_heads}"
            )
        if self.family == "llama" and self.ffn_dim == 0:
            raise ValueError(
                f"model {self.name!r}: a llama spec needs ffn_dim (the SwiGLU MLP width, e.g. 11008 "
                f"for LLaMA-2 7B), found 0"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.kv_heads}; each key/value head serves a whole group of query heads"
            )

    @property
    def num_layers(self) -> int:
        """Embedding + blocks + head."""
        return self.num_blocks + 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def ffn(self) -> int:
        """The MLP width f actually used (ffn_dim, or 4 * d_model when it is 0)."""
        return self.ffn_dim or 4 * self.d_model

    @property
    def act(self) -> str:
        """The MLP activation actually used (activation, or the family's when it is "")."""
        return self.activation or DEFAULT_ACTIVATION[self.family]

    @property
    def kv_heads(self) -> int:
        """The key/value head count k actually used (num_kv_heads, or num_heads when it is 0)."""
        return self.num_kv_heads or self.num_heads

    @property
    def param_count(self) -> int:
        return sum(layer_param_counts(self))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(**d)


def block_matmul_params(spec: ModelSpec) -> int:
    """Weights of a block's matmuls (no biases, no norms): the "n" of 2*n FLOPs per token."""
    d, f = spec.d_model, spec.ffn
    if spec.family == "llama":
        return 2 * d * d + 2 * d * spec.kv_heads * spec.head_dim + 3 * d * f
    return 4 * d * d + 2 * d * f


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of each layer, embedding first, head last (see the module docstring)."""
    d, v, t, f = spec.d_model, spec.vocab_size, spec.seq_len, spec.ffn
    if spec.family == "llama":
        bias = d + 2 * spec.kv_heads * spec.head_dim if spec.qkv_bias else 0
        embedding, block, head = v * d, block_matmul_params(spec) + 2 * d + bias, v * d + d
    else:
        p = spec.positions or t
        embedding, block, head = v * d + p * d, block_matmul_params(spec) + f + 9 * d, v * d + 2 * d
    return [embedding] + [block] * spec.num_blocks + [head]


_SEQ = 2048
_VOCAB = 50257


def _gpt3(name: str, blocks: int, d: int, heads: int) -> ModelSpec:
    return ModelSpec(name=name, num_blocks=blocks, d_model=d, num_heads=heads, seq_len=_SEQ, vocab_size=_VOCAB)


def _llama2(name: str, blocks: int, d: int, heads: int, kv: int, ffn: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_blocks=blocks,
        d_model=d,
        num_heads=heads,
        seq_len=4096,
        vocab_size=32000,
        family="llama",
        ffn_dim=ffn,
        num_kv_heads=kv,
        activation="silu",
    )


_TABLE = (
    # GPT-3 family, Brown et al. 2020 ("Language Models are Few-Shot Learners"), Table 2.1.
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16),
    # The paper lists 24 heads with d_head 128, which is inconsistent (24 * 128 = 3072 != 2048, and
    # 2048 % 24 != 0); we keep d_head 128 and use 16 heads.
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    # The paper prints d_model 5140 (not a multiple of 40 heads); implementations and Fuyou use 5120.
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96),
    # Larger models from Fuyou (Liao et al. 2024, "Adding NVMe SSDs to Enable and Accelerate 100B Model
    # Fine-tuning on a Single GPU"), Table 4 "Models for evaluation".
    _gpt3("gpt3-33b", 60, 6656, 52),
    _gpt3("gpt3-65b", 80, 8192, 64),
    _gpt3("gpt3-135b", 88, 11264, 88),
    _gpt3("gpt3-276b", 112, 14336, 112),
    _gpt3("gpt3-412b", 128, 16384, 128),
    _gpt3("gpt3-805b", 160, 20480, 160),
    # LLaMA-2, Touvron et al. 2023 ("Llama 2: Open Foundation and Fine-Tuned Chat Models") and the
    # config.json files Meta published with the weights (intermediate_size, num_key_value_heads).
    _llama2("llama2-7b", 32, 4096, 32, 32, 11008),
    _llama2("llama2-13b", 40, 5120, 40, 40, 13824),
    _llama2("llama2-70b", 80, 8192, 64, 8, 28672),
)

MODELS: MappingProxyType[str, ModelSpec] = MappingProxyType({m.name: m for m in _TABLE})
"""Known model specs by name (lower case), read-only."""
