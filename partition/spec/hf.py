"""A ModelSpec from a Hugging Face `config.json` on local disk (read as JSON; nothing is downloaded).

Supported `model_type`s and the keys read (all positive integers unless said otherwise):
  llama, mistral, qwen2  (family "llama")  num_hidden_layers, hidden_size, num_attention_heads,
                         intermediate_size, vocab_size, max_position_embeddings; num_key_value_heads
                         optional (default num_attention_heads); head_dim optional, must equal
                         hidden_size / num_attention_heads
  gpt2                   (family "gpt")    n_layer, n_embd, n_head, n_positions, vocab_size; n_inner
                         optional or null (null = 4 * n_embd)
Read for the activations a training forward keeps (partition.spec.analytic): a llama's hidden_act (default "silu")
and attention_dropout (default 0); GPT-2's activation_function (default "gelu_new") and embd_pdrop, resid_pdrop and
attn_pdrop (default 0.1 each), transformers' defaults where a key is absent; an activation outside
partition.spec.models.ACTIVATIONS is refused.
Counted as the runtime trains them (mobiuspipe.models.hf), parameter for parameter: qwen2's q/k/v biases
counted; a tied head (tie_word_embeddings) counted in full, as its stage holds its own copy; gpt2's
position table has n_positions rows whatever the sequence length; llama/mistral with attention_bias or
mlp_bias are refused.
The model's name is the folder's name for `folder/config.json` (or a folder), else the file's stem.
"""

from __future__ import annotations

import json
from pathlib import Path

from foundation.errors import UserError
from partition.spec.models import ACTIVATIONS, ModelSpec

__all__ = ["ModelConfigError", "SUPPORTED", "read_hf_config", "spec_from_hf_dict"]


class ModelConfigError(UserError, ValueError):
    """A model config.json that cannot be read as a spec: the message names the file, the key and its meaning."""


_LLAMA = {
    "num_hidden_layers": "the number of transformer blocks",
    "hidden_size": "the model width d",
    "num_attention_heads": "the number of attention (query) heads",
    "intermediate_size": "the MLP width of a llama block",
    "vocab_size": "the vocabulary size",
    "max_position_embeddings": "the sequence length the model is trained on",
}
_GPT2 = {
    "n_layer": "the number of transformer blocks",
    "n_embd": "the model width d",
    "n_head": "the number of attention heads",
    "n_positions": "the sequence length (the size of the position table)",
    "vocab_size": "the vocabulary size",
}
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt"}
"""model_type -> spec family."""


def _int(d: dict, key: str, meaning: str, where: str) -> int:
    """The required positive integer `d[key]`; ModelConfigError names the key when it is missing or not one."""
    if key not in d:
        raise ModelConfigError(f"{where}: missing {key!r} ({meaning})")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelConfigError(f"{where}: {key!r} ({meaning}) must be a positive integer, found {v!r}")
    return v


def _opt_int(d: dict, key: str, meaning: str, where: str) -> int | None:
    """`d[key]` as _int reads it, or None when the key is missing or null."""
    if d.get(key) is None:
        return None
    return _int(d, key, meaning, where)


def _activation(d: dict, key: str, default: str, where: str) -> str:
    """The MLP activation `d[key]` (default when absent); ModelConfigError when it is not one the planner counts."""
    v = d.get(key, default)
    if v not in ACTIVATIONS:
        raise ModelConfigError(
            f"{where}: {key!r} is {v!r}; the planner counts what these activations keep for backward: "
            f"{', '.join(ACTIVATIONS)}; use a model with one of them"
        )
    return v


def _probability(d: dict, key: str, default: float, where: str) -> float:
    """The dropout probability `d[key]` (default when absent or null), a number in [0, 1)."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
        raise ModelConfigError(f"{where}: {key!r} (a dropout probability) must be a number in [0, 1), found {v!r}")
    return float(v)


def _llama_spec(d: dict, name: str, where: str) -> ModelSpec:
    n = {k: _int(d, k, m, where) for k, m in _LLAMA.items()}
    kv = _opt_int(d, "num_key_value_heads", "the number of key/value heads", where)
    head_dim = _opt_int(d, "head_dim", "the width of one attention head", where)
    if head_dim is not None and head_dim * n["num_attention_heads"] != n["hidden_size"]:
        raise ModelConfigError(
            f"{where}: 'head_dim' {head_dim} x 'num_attention_heads' {n['num_attention_heads']} != 'hidden_size' "
            f"{n['hidden_size']}; only models whose heads split hidden_size exactly are supported"
        )
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ModelConfigError(
                f"{where}: {key!r} is true; llama-family models with biases in their projections are not supported "
                f"(supported: {', '.join(SUPPORTED)} as their reference checkpoints are, without these biases)"
            )
    return ModelSpec(
        name=name,
        num_blocks=n["num_hidden_layers"],
        d_model=n["hidden_size"],
        num_heads=n["num_attention_heads"],
        seq_len=n["max_position_embeddings"],
        vocab_size=n["vocab_size"],
        family="llama",
        ffn_dim=n["intermediate_size"],
        num_kv_heads=kv or 0,
        qkv_bias=d["model_type"] == "qwen2",
        activation=_activation(d, "hidden_act", "silu", where),
        attn_dropout=_probability(d, "attention_dropout", 0.0, where),
    )


def _gpt2_spec(d: dict, name: str, where: str) -> ModelSpec:
    n = {k: _int(d, k, m, where) for k, m in _GPT2.items()}
    inner = _opt_int(d, "n_inner", "the MLP width; null means 4 * n_embd", where)
    return ModelSpec(
        name=name,
        num_blocks=n["n_layer"],
        d_model=n["n_embd"],
        num_heads=n["n_head"],
        seq_len=n["n_positions"],
        vocab_size=n["vocab_size"],
        family="gpt",
        ffn_dim=inner or 0,
        positions=n["n_positions"],
        activation=_activation(d, "activation_function", "gelu_new", where),
        embd_dropout=_probability(d, "embd_pdrop", 0.1, where),
        resid_dropout=_probability(d, "resid_pdrop", 0.1, where),
        attn_dropout=_probability(d, "attn_pdrop", 0.1, where),
    )


def spec_from_hf_dict(d: dict, name: str, where: str = "config.json") -> ModelSpec:
    """The spec of a parsed config.json `d`; `where` names the file in error messages."""
    if not isinstance(d, dict):
        raise ModelConfigError(f"{where}: expected a JSON object of model settings, found {type(d).__name__}")
    if "model_type" not in d:
        raise ModelConfigError(f"{where}: missing 'model_type' (the architecture: one of {', '.join(SUPPORTED)})")
    kind = d["model_type"]
    if kind not in SUPPORTED:
        raise ModelConfigError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    try:
        return _llama_spec(d, name, where) if SUPPORTED[kind] == "llama" else _gpt2_spec(d, name, where)
    except ModelConfigError:
        raise
    except ValueError as e:  # ModelSpec's own checks (e.g. heads that do not divide the width)
        raise ModelConfigError(f"{where}: {e}") from None


def _locate(path: Path) -> tuple[Path, str]:
    """(the config file, the model's name) for a file or a folder holding config.json."""
    if path.is_dir():
        return path / "config.json", path.resolve().name
    name = path.resolve().parent.name if path.name == "config.json" else path.stem
    return path, name


def read_hf_config(path: str | Path) -> ModelSpec:
    """The spec of the config.json at `path` (a file, or a folder holding config.json)."""
    file, name = _locate(Path(path))
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelConfigError(
            f"cannot read model config {file}: {e.strerror or e}; expected a Hugging Face "
            f"config.json (or a folder holding one), or a known model name"
        ) from e
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}); expected a config.json") from e
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    return spec_from_hf_dict(d, name or file.stem, str(file))
