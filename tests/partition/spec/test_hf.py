"""Model specs from local Hugging Face config.json files (hand-written copies under data/, no downloads)."""

import json
from pathlib import Path

import pytest

from partition.errors import UnknownModelError
from partition.spec.hf import ModelConfigError, read_hf_config, spec_from_hf_dict
from partition.spec.lookup import get_model
from partition.spec.models import MODELS

DATA = Path(__file__).parents[1] / "data"
LLAMA_TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "max_position_embeddings": 32,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 97,
}


def test_llama2_7b_config_equals_the_table_entry():
    spec = get_model(str(DATA / "llama2-7b-hf" / "config.json"))
    assert spec.name == "llama2-7b-hf"  # the folder's name
    ref = MODELS["llama2-7b"]
    assert spec.to_dict() == {**ref.to_dict(), "name": "llama2-7b-hf"}
    assert spec.param_count == 6_738_415_616


def test_a_folder_is_read_as_its_config_json():
    assert get_model(str(DATA / "llama2-7b-hf")) == read_hf_config(DATA / "llama2-7b-hf" / "config.json")


def test_mistral_grouped_query_attention():
    spec = get_model(str(DATA / "mistral-7b.json"))
    assert spec.name == "mistral-7b"  # the file's stem
    assert (spec.family, spec.kv_heads, spec.ffn, spec.seq_len) == ("llama", 8, 14336, 32768)
    assert abs(spec.param_count - 7.24e9) / 7.24e9 < 0.01  # Mistral 7B's published 7.24B


def test_gpt2_config_with_null_n_inner():
    spec = get_model(str(DATA / "tiny-gpt2"))
    assert (spec.name, spec.family, spec.num_blocks, spec.d_model, spec.num_heads) == ("tiny-gpt2", "gpt", 6, 64, 4)
    assert (spec.seq_len, spec.vocab_size, spec.ffn_dim, spec.ffn) == (32, 97, 0, 256)


def test_gpt2_124m_shape_counts_like_gpt2():
    d = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
        "n_inner": None,
    }
    spec = spec_from_hf_dict(d, "gpt2")
    assert spec.param_count - 50257 * 768 == 124_439_808  # GPT-2 small, tied head: the well-known 124M


def test_what_the_activations_depend_on_is_read_with_transformers_defaults():
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32, "vocab_size": 97}
    spec = spec_from_hf_dict(gpt2, "g")  # GPT2Config's defaults: gelu_new, 0.1 dropouts
    assert (spec.act, spec.embd_dropout, spec.resid_dropout, spec.attn_dropout) == ("gelu_new", 0.1, 0.1, 0.1)
    d = {**gpt2, "activation_function": "relu", "embd_pdrop": 0, "resid_pdrop": 0.0, "attn_pdrop": None}
    spec = spec_from_hf_dict(d, "g")
    assert (spec.act, spec.embd_dropout, spec.resid_dropout, spec.attn_dropout) == ("relu", 0.0, 0.0, 0.1)
    assert (spec_from_hf_dict(LLAMA_TINY, "l").act, spec_from_hf_dict(LLAMA_TINY, "l").attn_dropout) == ("silu", 0.0)
    assert spec_from_hf_dict({**LLAMA_TINY, "attention_dropout": 0.05}, "l").attn_dropout == 0.05


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_act": "gelu_fast"}, r"c.json: 'hidden_act' is 'gelu_fast'; the planner counts .*: gelu, .*silu"),
        ({"attention_dropout": 1.5}, r"'attention_dropout' \(a dropout probability\) must be a number in \[0, 1\)"),
        ({"attention_dropout": "0.1"}, "found '0.1'"),
    ],
)
def test_an_activation_or_dropout_the_planner_cannot_count_is_refused(change, needle):
    with pytest.raises(ModelConfigError, match=needle):
        spec_from_hf_dict({**LLAMA_TINY, **change}, "l", "c.json")


def test_qwen2_is_llama_style():
    spec = spec_from_hf_dict({**LLAMA_TINY, "model_type": "qwen2", "num_key_value_heads": 2}, "q")
    assert (spec.family, spec.kv_heads) == ("llama", 2)


def test_missing_field_names_file_field_and_meaning():
    with pytest.raises(ModelConfigError) as err:
        get_model(str(DATA / "no-ffn-llama.json"))
    msg = str(err.value)
    assert "no-ffn-llama.json" in msg and "missing 'intermediate_size' (the MLP width of a llama block)" in msg
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("key", ["n_layer", "n_embd", "n_head", "n_positions", "vocab_size"])
def test_every_gpt2_field_is_required(key):
    d = {"model_type": "gpt2", "n_layer": 2, "n_embd": 8, "n_head": 2, "n_positions": 4, "vocab_size": 16}
    del d[key]
    with pytest.raises(ModelConfigError, match=f"missing '{key}'"):
        spec_from_hf_dict(d, "x")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_size": "64"}, "'hidden_size' (the model width d) must be a positive integer, found '64'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_attention_heads": 5}, "multiple of num_heads"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"head_dim": 32}, "'head_dim' 32"),
    ],
)
def test_bad_values(change, needle):
    with pytest.raises(ModelConfigError, match=None) as err:
        spec_from_hf_dict({**LLAMA_TINY, **change}, "x", "cfg.json")
    assert needle in str(err.value) and "cfg.json" in str(err.value)


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ModelConfigError) as err:
        get_model(str(DATA / "bert.json"))
    for name in ("'bert'", "llama", "mistral", "qwen2", "gpt2"):
        assert name in str(err.value)


def test_missing_model_type():
    with pytest.raises(ModelConfigError, match="missing 'model_type'"):
        spec_from_hf_dict({"hidden_size": 8}, "x")


def test_unreadable_files(tmp_path):
    with pytest.raises(ModelConfigError, match="cannot read model config"):
        get_model(str(tmp_path / "nothing" / "config.json"))
    with pytest.raises(ModelConfigError, match="cannot read model config"):
        get_model(str(tmp_path))  # a folder without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="bad.json: not valid JSON"):
        get_model(str(bad))
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([1, 2]))
    with pytest.raises(ModelConfigError, match="JSON object"):
        get_model(str(arr))


def test_plain_unknown_names_stay_unknown_model_errors():
    with pytest.raises(UnknownModelError):
        get_model("llama3-8b")
