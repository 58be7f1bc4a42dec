"""The run config's LoRA: the lora section and model.adapter checked, the adapters counted on the model's own
layers (and by the partition package's table for a Hugging Face model), and the start-up plan of an adapted
model; a plan file made without them is refused."""

from __future__ import annotations

import json

import pytest

from mobiuspipe.config import config_from_dict
from mobiuspipe.errors import ConfigError
from mobiuspipe.lora.layers import adapter_parameters, add_adapters
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.gpt import build_layers
from mobiuspipe.startup.config_plan import adapters, model_spec, plan_for_config
from mobiuspipe.startup.lora import adapter_counts, default_targets, lora_spec
from partition.plan import save_plan
from partition.spec.lora import LoraShape
from partition.spec.lora import adapter_counts as table_counts

GPT = {"num_blocks": 3, "d_model": 12, "num_heads": 3, "seq_len": 9}


def _cfg(tmp_path=None, lora=None, **model):
    doc = {
        "model": {**GPT, **model} if "hf" not in model else model,
        "train": {"precision": "fp32"},
        "plan": {"num_gpus": 2, "num_stages": 3},
    }
    return config_from_dict(doc | ({"lora": lora} if lora is not None else {}), base_dir=tmp_path)


def test_no_lora_section_trains_every_weight():
    cfg = _cfg()
    assert not cfg.lora_on and lora_spec(cfg) is None and adapters(cfg) is None


def test_the_built_in_gpts_adapters_are_counted_on_its_layers():
    cfg = _cfg(lora={"rank": 2, "targets": ["qkv", "out"]})
    spec = lora_spec(cfg)
    assert spec is not None and spec == LoraSpec(
        rank=2, alpha=2.0, targets=("out", "qkv")
    )  # alpha null: the rank, a scale of 1
    layers = build_layers(model_spec(cfg), seed=0)
    for layer in layers.values():
        add_adapters(layer, spec)
    real = [sum(p.numel() for p in adapter_parameters(layers[l]).values()) for l in sorted(layers)]
    assert adapter_counts(cfg, spec) == real == [0] + [2 * (12 + 36) + 2 * (48 + 12)] * 3 + [0]
    assert default_targets(cfg) == ("qkv",)


def test_a_hugging_face_models_adapters_are_the_tables(tmp_path, hf_kit):
    """The partition package's table (partition.spec.lora, for `partition --lora`) counts what the layers hold."""
    for kind, targets in (("llama", ("q_proj", "k_proj", "down_proj", "lm_head")), ("gpt2", ("c_proj", "c_attn"))):
        hf_kit.save_model(kind, tmp_path / kind)
        cfg = _cfg(tmp_path, lora={"rank": 3, "targets": list(targets)}, hf=kind, seq_len=11)
        spec = lora_spec(cfg)
        assert spec is not None and adapter_counts(cfg, spec) == table_counts(model_spec(cfg), LoraShape(3, targets))


def test_the_start_up_plan_counts_the_adapters_and_a_plan_without_them_is_refused(tmp_path):
    cfg = _cfg(tmp_path, lora={"rank": 2, "targets": ["qkv"]})
    plan = plan_for_config(cfg)
    a = adapters(cfg)
    assert a is not None and sum(s.trains for s in plan.stages) == sum(a) > 0
    assert [s.trainable_count for s in plan.stages] == [sum(a[s.first : s.last + 1]) for s in plan.stages]
    save_plan(plan_for_config(_cfg(tmp_path)), tmp_path / "full.yaml")
    with_file = config_from_dict(
        cfg.to_dict() | {"plan": cfg.to_dict()["plan"] | {"file": str(tmp_path / "full.yaml")}}, base_dir=tmp_path
    )
    with pytest.raises(ConfigError, match=r"parameters here \(\d+ train\), \d+ in the plan \(\d+ train\)"):
        plan_for_config(with_file)


@pytest.mark.parametrize(
    "lora,model,key,words",
    [
        ({"alpha": 8}, {}, "lora.alpha", "without lora.rank"),
        ({"rank": 0}, {}, "lora.rank", "an adapter rank >= 1"),
        ({"rank": 4, "dropout": 1.0}, {}, "lora.dropout", "a probability in [0, 1)"),
        ({"rank": 4, "targets": []}, {}, "lora.targets", "a non-empty list"),
        (None, {"adapter": "."}, "model.adapter", "model.hf beside it"),
    ],
)
def test_lora_keys_are_checked(tmp_path, lora, model, key, words):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, lora=lora, **model)
    assert key in str(e.value) and words in str(e.value)


@pytest.mark.parametrize(
    "lora,memory,key,words",
    [
        (None, {"frozen": "ssd", "ssd_dir": "s"}, "memory.frozen", "frozen 'ssd' without LoRA"),
        ({"rank": 2}, {"frozen": "ssd"}, "memory.ssd_dir", "a folder when frozen is ssd"),
        ({"rank": 2}, {"frozen": "disk"}, "memory.frozen", "one of host, ssd"),
        ({"rank": 2}, {"optimizer": "device", "weights": "auto"}, "memory.weights", "when optimizer is device"),
        ({"rank": 2}, {"optimizer": "gpu"}, "memory.optimizer", "one of host, ssd, auto, device"),
    ],
)
def test_memory_frozen_is_checked(tmp_path, lora, memory, key, words):
    doc = _cfg(lora=lora).to_dict() | {"memory": memory}
    with pytest.raises(ConfigError) as e:
        config_from_dict(doc, base_dir=tmp_path)
    assert key in str(e.value) and words in str(e.value)


def test_memory_frozen_ssd_with_lora_is_taken(tmp_path):
    doc = _cfg(lora={"rank": 2}).to_dict() | {"memory": {"frozen": "ssd", "ssd_dir": "s"}}
    assert config_from_dict(doc, base_dir=tmp_path).memory.frozen == "ssd"


def test_a_target_the_model_lacks_is_refused_naming_its_linear_layers():
    cfg = _cfg(lora={"rank": 2, "targets": ["qkv", "c_attn"]})
    with pytest.raises(ConfigError, match=r"lora.targets: expected names of the model's linear layers \(qkv, proj, "
                       r"fc, out, lm; .*found c_attn"):  # fmt: skip
        adapters(cfg)


def test_model_adapter_gives_the_spec_and_a_lora_key_against_it_is_refused(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "base")
    (tmp_path / "ad").mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"]}
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(config))
    cfg = _cfg(tmp_path, hf="base", adapter="ad", seq_len=11)
    assert cfg.lora_on and lora_spec(cfg) == LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    same = _cfg(tmp_path, lora={"rank": 4, "targets": ["q_proj", "v_proj"]}, hf="base", adapter="ad", seq_len=11)
    assert lora_spec(same) == lora_spec(cfg)
    other = _cfg(tmp_path, lora={"rank": 8, "alpha": 8}, hf="base", adapter="ad", seq_len=11)
    with pytest.raises(ConfigError, match=r"lora.rank 8 \(the adapter's: 4\): remove those lora keys"):
        lora_spec(other)


@pytest.mark.parametrize(("base_dtype", "most"), [("nf4", 0.3), ("int8", 0.55)])
def test_a_quantized_bases_items_and_bytes_are_the_tables(tmp_path, hf_kit, base_dtype, most):
    """lora.base_dtype int8 / nf4: the plan counts each layer's items and bytes as the quantized layers hold them."""
    from mobiuspipe.lora.layers import with_adapters
    from mobiuspipe.lora.quant import quantized
    from mobiuspipe.models.hf import layer_factories, open_hf
    from mobiuspipe.startup.config_plan import frozen_base

    hf_kit.save_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256, num_attention_heads=4)
    cfg = _cfg(tmp_path, lora={"rank": 2, "targets": ["q_proj"], "base_dtype": base_dtype}, hf="m", seq_len=11)
    spec, a, base = lora_spec(cfg), adapters(cfg), frozen_base(cfg)
    assert spec is not None and spec.base_dtype == base_dtype and a is not None and base is not None
    made = quantized(with_adapters(layer_factories(open_hf(tmp_path / "m", 11)), spec), base_dtype)
    layers = [make() for make in made]
    items = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    nbytes = [
        sum(p.numel() * (4 if p.is_floating_point() else p.element_size()) for p in x.parameters()) for x in layers
    ]
    assert items == [n + k for n, k in zip(base.items, a)] and nbytes == [b + 4 * k for b, k in zip(base.nbytes, a)]
    from partition.spec.models import layer_param_counts

    assert nbytes[1] < most * 4 * layer_param_counts(model_spec(cfg))[1]  # the block's projections quantized
    plan = plan_for_config(cfg)
    assert [s.param_count for s in plan.stages] == [sum(items[s.first : s.last + 1]) for s in plan.stages]
