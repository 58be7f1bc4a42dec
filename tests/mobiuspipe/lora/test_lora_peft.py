"""LoRA against peft itself: a tiny Llama and GPT-2 cut into the pipeline's layers, with adapters added on PEFT's
target modules, give peft's logits and the adapters' gradients (the base frozen: no gradient); an adapter saved
here loads into PeftModel.from_pretrained with the same logits, and one peft saved loads here unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobiuspipe.lora.layers import LoraLinear, adapter_parameters, add_adapters, linear_names
from mobiuspipe.lora.peft_format import load_adapter, save_adapter
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import build_layer, hf_key, open_hf

peft = pytest.importorskip("peft")

TARGETS = {"llama": ("q_proj", "v_proj", "o_proj", "down_proj"), "gpt2": ("c_attn", "c_fc")}


def _peft_model(hf_kit, kind: str, folder, spec: LoraSpec, seed: int):
    """transformers' model of `folder` with peft's adapter, B random (a new one's is zero)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.rslora,
        fan_in_fan_out=kind == "gpt2",
    )
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _our_layers(folder, spec: LoraSpec) -> tuple[object, list[nn.Module]]:
    m = open_hf(folder, 16)
    layers = [build_layer(m, l) for l in range(m.num_layers)]
    for layer in layers:
        add_adapters(layer, spec, torch.Generator().manual_seed(1))
    return m, layers


def _copy_adapters(m, layers: list[nn.Module], peft_state: dict[str, torch.Tensor]) -> int:
    """peft's adapter tensors into our layers, by the checkpoint name; returns how many."""
    copied = 0
    with torch.no_grad():
        for l, layer in enumerate(layers):
            for name, p in adapter_parameters(layer).items():
                p.copy_(peft_state["base_model.model." + hf_key(m, l, name)])
                copied += 1
    return copied


def _logits(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("kind,rslora", [("llama", False), ("gpt2", True)])
def test_adapted_layers_give_peft_logits_and_gradients(tmp_path, hf_kit, kind, rslora):
    hf_kit.save_model(kind, tmp_path / "base", seed=2)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS[kind], rslora=rslora)
    ref = _peft_model(hf_kit, kind, tmp_path / "base", spec, seed=3)
    m, layers = _our_layers(tmp_path / "base", spec)
    state = peft.get_peft_model_state_dict(ref)
    assert _copy_adapters(m, layers, state) == len(state) > 0
    x = torch.randint(0, hf_kit.VOCAB, (2, 13))
    y = torch.randint(0, hf_kit.VOCAB, (2, 13))
    ours = _logits(layers, x)
    want = ref(x).logits
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    lm_loss(ours, y).backward()
    lm_loss(want, y).backward()
    ref_grads = {k.replace(".default", ""): p.grad for k, p in ref.named_parameters() if p.requires_grad}
    for l, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if name in adapter_parameters(layer):
                torch.testing.assert_close(
                    p.grad, ref_grads["base_model.model." + hf_key(m, l, name)], rtol=1e-5, atol=1e-6
                )
            else:
                assert not p.requires_grad and p.grad is None, name  # the base stays frozen


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_adapter_saved_here_loads_into_peft_and_one_peft_saved_loads_here(tmp_path, hf_kit, kind):
    from transformers import AutoModelForCausalLM

    hf_kit.save_model(kind, tmp_path / "base", seed=4)
    spec = LoraSpec(rank=3, alpha=5.0, targets=TARGETS[kind], dropout=0.1)
    m, layers = _our_layers(tmp_path / "base", spec)
    with torch.no_grad():
        for layer in layers:
            for p in adapter_parameters(layer).values():
                p.add_(torch.randn(p.shape) * 0.05)  # B nonzero: the adapter changes the logits
            layer.eval()
    tensors = {
        hf_key(m, l, n): p.detach() for l, layer in enumerate(layers) for n, p in adapter_parameters(layer).items()
    }
    save_adapter(tmp_path / "adapter", spec, tensors, str(tmp_path / "base"), fan_in_fan_out=kind == "gpt2")
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="sdpa")
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    x = torch.randint(0, hf_kit.VOCAB, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(_logits(layers, x), loaded(x).logits, rtol=1e-5, atol=1e-5)
    loaded.save_pretrained(str(tmp_path / "resaved"))
    back_spec, back = load_adapter(tmp_path / "resaved")
    assert back_spec == spec and back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in back)


def test_a_new_adapter_starts_as_the_base_model_and_names_its_targets(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "base", seed=5)
    m = open_hf(tmp_path / "base", 16)
    plain = build_layer(m, 1)
    adapted = build_layer(m, 1)
    wrapped = add_adapters(adapted, LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "up_proj")))
    assert wrapped == ["layer.self_attn.q_proj", "layer.mlp.up_proj"]
    assert isinstance(adapted.get_submodule("layer.self_attn.q_proj"), LoraLinear)
    assert "layer.mlp.gate_proj" in linear_names(adapted)
    h = torch.randn(2, 7, 24)
    torch.testing.assert_close(adapted(h), plain(h), rtol=0, atol=0)  # B = 0
    assert sorted(adapter_parameters(adapted)) == [
        "layer.mlp.up_proj.lora_A.weight",
        "layer.mlp.up_proj.lora_B.weight",
        "layer.self_attn.q_proj.lora_A.weight",
        "layer.self_attn.q_proj.lora_B.weight",
    ]


def test_an_adapter_folder_that_is_not_plain_lora_is_refused(tmp_path):
    from mobiuspipe.errors import ConfigError

    (tmp_path / "a").mkdir()
    with pytest.raises(ConfigError, match=r"model.adapter: expected an adapter folder, found .* without a readable"):
        load_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "use_dora": true, "bias": "all", "r": 2}'
    )
    with pytest.raises(ConfigError, match=r"bias 'all' \(only 'none' is read\); use_dora True \(only False"):
        load_adapter(tmp_path / "a")
