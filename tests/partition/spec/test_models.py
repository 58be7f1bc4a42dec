"""Model spec table, parameter counts and the device spec table."""

import pytest

from partition.errors import UnknownModelError
from partition.spec.hardware import DEVICES, MFU_DEFAULT, DeviceSpec, device_spec
from partition.spec.lookup import get_model
from partition.spec.models import MODELS, ModelSpec, layer_param_counts

# Nominal sizes (the names) with a tied head, as the papers count them.
NOMINAL = {
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-760m": 760e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
    "gpt3-33b": 33e9,
    "gpt3-65b": 65e9,
    "gpt3-135b": 135e9,
    "gpt3-276b": 276e9,
    "gpt3-412b": 412e9,
    "gpt3-805b": 805e9,
}


def untied_total(L: int, d: int, V: int = 50257, T: int = 2048) -> int:
    return (V * d + T * d) + L * (12 * d * d + 13 * d) + (V * d + 2 * d)


# Published totals of LLaMA-2 (untied head, no biases): 6.74B, 13.0B, 69.0B (Touvron et al. 2023).
LLAMA2 = {"llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama2-70b": 69.0e9}


def test_table_has_every_model():
    assert set(MODELS) == set(NOMINAL) | set(LLAMA2)
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.d_model % spec.num_heads == 0
        if name in NOMINAL:
            assert spec.family == "gpt" and spec.seq_len == 2048 and spec.vocab_size == 50257
            assert (spec.ffn_dim, spec.num_kv_heads, spec.ffn, spec.kv_heads) == (
                0,
                0,
                4 * spec.d_model,
                spec.num_heads,
            )
        else:
            assert spec.family == "llama" and spec.seq_len == 4096 and spec.vocab_size == 32000


@pytest.mark.parametrize("name", sorted(LLAMA2))
def test_llama2_totals(name):
    assert abs(MODELS[name].param_count - LLAMA2[name]) / LLAMA2[name] < 0.01


def test_llama2_exact_and_shapes():
    assert MODELS["llama2-7b"].param_count == 6_738_415_616  # the count of the released checkpoint
    s70 = MODELS["llama2-70b"]
    assert (s70.num_blocks, s70.d_model, s70.num_heads, s70.kv_heads, s70.ffn, s70.head_dim) == (
        80,
        8192,
        64,
        8,
        28672,
        128,
    )
    assert MODELS["llama2-13b"].num_layers == 42


def test_llama_layer_structure():
    spec = ModelSpec(
        "tl", num_blocks=2, d_model=8, num_heads=4, seq_len=5, vocab_size=16, family="llama", ffn_dim=12, num_kv_heads=2
    )
    # embedding V*d (no position table); block 2d + q d*d + k,v d*(kv*hd) + o d*d + 3*d*f; head d + V*d
    block = 2 * 8 + 64 + 2 * 8 * (2 * 2) + 64 + 3 * 8 * 12
    assert layer_param_counts(spec) == [16 * 8, block, block, 8 + 16 * 8]
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_gpt_with_own_mlp_width():
    spec = ModelSpec("g", num_blocks=1, d_model=8, num_heads=2, seq_len=4, vocab_size=16, ffn_dim=20)
    # 2 LN 4d + qkv 3d^2+3d + proj d^2+d + fc d*f+f + out f*d+d
    assert layer_param_counts(spec)[1] == 4 * 8 + 3 * 64 + 24 + 64 + 8 + 8 * 20 + 20 + 20 * 8 + 8
    same = ModelSpec("g", num_blocks=1, d_model=8, num_heads=2, seq_len=4, vocab_size=16, ffn_dim=32)
    assert layer_param_counts(same) == layer_param_counts(ModelSpec("g", 1, 8, 2, 4, 16))


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"family": "bert"}, "family"),
        ({"ffn_dim": -1}, "ffn_dim"),
        ({"num_kv_heads": 1.5}, "num_kv_heads"),
        ({"num_kv_heads": 1}, "grouped-query"),  # gpt has no GQA
        ({"family": "llama"}, "ffn_dim"),  # llama needs its MLP width
        ({"family": "llama", "ffn_dim": 8, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"activation": "mish"}, r"activation 'mish' is not supported; supported: gelu, .*gelu_new"),
        ({"resid_dropout": 1.0}, r"resid_dropout must be a probability in \[0, 1\), found 1.0"),
        ({"attn_dropout": -0.1}, "attn_dropout"),
        ({"embd_dropout": True}, "embd_dropout"),
        ({"family": "llama", "ffn_dim": 8, "resid_dropout": 0.1}, "no embedding or residual dropout"),
    ],
)
def test_spec_rejects_bad_family_fields(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ModelSpec(**{**dict(name="x", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16), **kw})


def test_old_spec_dicts_still_load():
    d = {"name": "x", "num_blocks": 2, "d_model": 8, "num_heads": 2, "seq_len": 4, "vocab_size": 16}
    spec = ModelSpec.from_dict(d)
    assert (spec.family, spec.act, spec.attn_dropout) == ("gpt", "gelu", 0.0)  # the built-in GPT's
    assert ModelSpec.from_dict({**d, "family": "llama", "ffn_dim": 8}).act == "silu"


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_param_count_matches_nominal_size(name):
    spec = MODELS[name]
    assert spec.param_count == untied_total(spec.num_blocks, spec.d_model)
    tied = spec.param_count - spec.vocab_size * spec.d_model
    assert abs(tied - NOMINAL[name]) / NOMINAL[name] < 0.04


def test_known_totals_exact():
    assert MODELS["gpt3-125m"].param_count == 163_823_616  # untied head, 2048 positions
    assert 124e6 < MODELS["gpt3-125m"].param_count - 50257 * 768 < 126e6  # tied: the GPT-3 paper's 125M
    assert MODELS["gpt3-175b"].param_count == 175_221_817_344
    assert 174e9 < MODELS["gpt3-175b"].param_count < 176e9


def test_layer_param_counts_structure():
    spec = ModelSpec("tiny", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16)
    assert layer_param_counts(spec) == [16 * 8 + 4 * 8, 12 * 64 + 13 * 8, 12 * 64 + 13 * 8, 16 * 8 + 2 * 8]
    assert spec.num_layers == 4 == len(layer_param_counts(spec))
    assert spec.param_count == 2048


def test_fixed_shapes():
    assert (MODELS["gpt3-1.3b"].num_heads, MODELS["gpt3-1.3b"].head_dim) == (16, 128)
    assert MODELS["gpt3-13b"].d_model == 5120
    assert MODELS["gpt3-175b"].num_layers == 98


@pytest.mark.parametrize(
    "field,value", [("num_blocks", 0), ("d_model", -8), ("num_heads", 2.0), ("seq_len", True), ("vocab_size", None)]
)
def test_spec_rejects_bad_numbers(field, value):
    kw = dict(name="x", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16)
    with pytest.raises(ValueError, match=field):
        ModelSpec(**{**kw, field: value})


def test_spec_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"2048.*24"):
        ModelSpec("bad", num_blocks=1, d_model=2048, num_heads=24, seq_len=8, vocab_size=8)


@pytest.mark.parametrize("name", ["gpt3-33b", "llama2-70b"])
def test_spec_round_trips(name):
    spec = MODELS[name]
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_get_model_case_insensitive():
    assert get_model("GPT3-175B") is MODELS["gpt3-175b"]
    assert get_model("gpt3-1.3b") is MODELS["gpt3-1.3b"]
    assert get_model("LLaMA2-70B") is MODELS["llama2-70b"]


def test_unknown_model_lists_names():
    with pytest.raises(UnknownModelError) as err:
        get_model("gpt3-7b")
    msg = str(err.value)
    assert "gpt3-7b" in msg
    for name in MODELS:
        assert name in msg
    assert "config.json" in msg


def test_device_lookup_full_and_short_names():
    full = device_spec("NVIDIA GeForce RTX 3090 Ti")
    assert full.peak_tflops == 80.0 and full.memory_bytes == 24 * 2**30 and full.pcie_gbps == 31.5
    assert device_spec("RTX 3090 Ti") is full
    assert device_spec("geforce rtx 3090 ti") is full
    assert device_spec("rtx 3090").peak_tflops == 71.0
    assert device_spec("rtx 4090").peak_tflops == 165.2
    assert device_spec("a100-sxm4-80gb").peak_tflops == 312.0
    assert device_spec("A100 80GB PCIe").memory_bytes == 80 * 2**30
    assert device_spec("H100 PCIe").peak_tflops == 756.0
    standin = device_spec("cpu-standin")
    assert (standin.peak_tflops, standin.memory_bytes, standin.pcie_gbps) == (0.05, 0, 10.0)


def test_device_short_names_unique():
    from partition.spec.hardware import _short

    assert len({_short(n) for n in DEVICES}) == len(DEVICES)


def test_unknown_device_lists_names():
    with pytest.raises(ValueError) as err:
        device_spec("RTX 2080")
    for name in DEVICES:
        assert name in str(err.value)


def test_device_spec_validates():
    with pytest.raises(ValueError, match="peak_tflops"):
        DeviceSpec("x", 0.0, 1, 1.0)
    assert 0 < MFU_DEFAULT <= 1
