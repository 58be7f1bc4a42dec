"""Model spec table, parameter counts and the device spec table."""

import pytest

from partition.errors import UnknownModelError
from partition.hardware import DEVICES, MFU_DEFAULT, DeviceSpec, device_spec
from partition.models import MODELS, ModelSpec, get_model, layer_param_counts

# Nominal sizes (the names) with a tied head, as the papers count them.
NOMINAL = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9, "gpt3-33b": 33e9, "gpt3-65b": 65e9,
    "gpt3-135b": 135e9, "gpt3-276b": 276e9, "gpt3-412b": 412e9, "gpt3-805b": 805e9,
}


def untied_total(L: int, d: int, V: int = 50257, T: int = 2048) -> int:
    return (V * d + T * d) + L * (12 * d * d + 13 * d) + (V * d + 2 * d)


def test_table_has_every_model():
    assert set(MODELS) == set(NOMINAL)
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.seq_len == 2048 and spec.vocab_size == 50257
        assert spec.d_model % spec.num_heads == 0


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


@pytest.mark.parametrize("field,value", [("num_blocks", 0), ("d_model", -8), ("num_heads", 2.0),
                                         ("seq_len", True), ("vocab_size", None)])
def test_spec_rejects_bad_numbers(field, value):
    kw = dict(name="x", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16)
    with pytest.raises(ValueError, match=field):
        ModelSpec(**{**kw, field: value})


def test_spec_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"2048.*24"):
        ModelSpec("bad", num_blocks=1, d_model=2048, num_heads=24, seq_len=8, vocab_size=8)


def test_spec_round_trips():
    spec = MODELS["gpt3-33b"]
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_get_model_case_insensitive():
    assert get_model("GPT3-175B") is MODELS["gpt3-175b"]
    assert get_model("gpt3-1.3b") is MODELS["gpt3-1.3b"]


def test_unknown_model_lists_names():
    with pytest.raises(UnknownModelError) as err:
        get_model("gpt3-7b")
    msg = str(err.value)
    assert "gpt3-7b" in msg
    for name in MODELS:
        assert name in msg


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
    from partition.hardware import _short

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
