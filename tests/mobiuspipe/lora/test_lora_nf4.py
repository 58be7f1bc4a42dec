"""QLoRA's NF4 base: the weights dequantize to torchao's NF4 bit for bit, a Pipeline with an NF4 base trains as
peft does on a model whose base weights are torchao's dequantized NF4 (the bytes through the stage's frozen slot
unchanged), the weight slot holds about a quarter of the bf16 base's bytes, and the run stays near the bf16 one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobiuspipe import LoraSpec
from mobiuspipe.lora.quant import NF4Linear, quantizable
from mobiuspipe.models.hf import hf_key, open_hf
from partition.spec.lora import nf4_bytes, nf4_numel

peft = pytest.importorskip("peft")
nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
"""q, o, gate, up and down are NF4 (multiples of 16,384 weights); k and v (8,192) and the head stay dense."""
TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.mark.parametrize("conv1d", [False, True])
def test_an_nf4_layer_is_torchaos_nf4_bit_for_bit(conv1d):
    torch.manual_seed(0)
    base = nn.Linear(256, 128, bias=True)
    if conv1d:
        from transformers.pytorch_utils import Conv1D

        conv = Conv1D(128, 256)  # weight [in, out]
        conv.weight.data.copy_(base.weight.data.T)
        conv.bias.data.copy_(base.bias.data)
        base = conv
    q = NF4Linear(base)
    want = nf4_tensor.to_nf4(base.weight.detach().bfloat16(), 64, 256).get_original_weight()
    assert torch.equal(q.weight(), want) and q.weight().dtype == torch.bfloat16
    codes = [p for n, p in q.named_parameters() if n != "bias"]
    assert sum(p.nbytes for p in codes) == nf4_bytes(base.weight.numel())  # the planner's count (partition)
    assert sum(p.numel() for p in codes) == nf4_numel(base.weight.numel())
    x = torch.randn(3, 5, 256)
    dense = want.float()
    ref = (x @ dense if conv1d else torch.nn.functional.linear(x, dense)) + base.bias
    assert torch.equal(q(x), ref)
    xg = x.clone().requires_grad_(True)  # the backward dequantizes again: the input gradient of the dense layer
    q(xg).sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, (torch.ones(3, 5, 128) @ (dense.t() if conv1d else dense)))


def _dequantized_base(folder):
    """The transformers model whose quantizable linear weights (not the head) are torchao's NF4, dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head" and quantizable(mod.weight):
                w = nf4_tensor.to_nf4(mod.weight.bfloat16(), 64, 256).get_original_weight()
                mod.weight.copy_(w.float())
    return model


def test_an_nf4_base_trains_as_peft_on_its_dequantized_weights(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "base", seed=4, **SIZES)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS, base_dtype="nf4")
    batches = hf_kit.random_batches(3, 8, 13, seed=5)
    with hf_kit.lora_pipeline(m, spec, batches) as pipe:
        before = pipe.state_dict(frozen=False)
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        slot = max(s.weight_nbytes for s in pipe.stages.values())
        kinds = {f.name.rsplit(".", 1)[-1] for s in pipe.stages.values() for f in s.frozen}
    assert {"qdata", "qscalers", "qfactor", "qmean", "weight"} <= kinds  # NF4 and dense frozen weights together
    config = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS))
    ref = peft.get_peft_model(_dequantized_base(tmp_path / "base"), config)
    start = {f"base_model.model.{hf_key(m, int(k.split('.')[0]), k.split('.', 1)[1])}": t for k, t in before.items()}
    assert not peft.set_peft_model_state_dict(ref, start).unexpected_keys
    want = hf_kit.train_plain(ref, batches, microbatches=4, lr=5e-3)
    assert got == pytest.approx(want, rel=1e-5), (got, want)

    dense = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    with hf_kit.lora_pipeline(m, dense, batches) as pipe:
        plain = [pipe.train_batch(x, y).loss for x, y in batches]
        dense_slot = max(s.weight_nbytes for s in pipe.stages.values())
    # the documented distance: NF4's rounding moves each step's loss by under 1% of the dense base's here
    assert got == pytest.approx(plain, rel=1e-2) and got != plain
    assert slot < 0.5 * dense_slot  # fp32 dense against NF4 codes (the head, k and v stay dense)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_nf4_run_resumes_bit_for_bit(tmp_path, hf_kit, precision):
    """The checkpoint holds the adapters; the NF4 base is quantized again from the model folder, the same bytes."""
    hf_kit.save_model("llama", tmp_path / "base", seed=2, **SIZES)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS, base_dtype="nf4")
    batches = hf_kit.random_batches(4, 8, 13, seed=3)
    torch.manual_seed(1)
    with hf_kit.lora_pipeline(m, spec, batches, precision) as pipe:
        straight = [pipe.train_batch(x, y).loss for x, y in batches]
        final = pipe.state_dict(frozen=False)
    torch.manual_seed(1)
    with hf_kit.lora_pipeline(m, spec, batches, precision) as pipe:
        first = [pipe.train_batch(x, y).loss for x, y in batches[:2]]
        folder = pipe.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(7)  # another seed: the adapters come from the checkpoint
    with hf_kit.lora_pipeline(m, spec, batches, precision) as pipe:
        assert pipe.load_checkpoint(folder) == 2
        rest = [pipe.train_batch(x, y).loss for x, y in batches[2:]]
        resumed = pipe.state_dict(frozen=False)
    assert first + rest == straight
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[k], final[k]) for k in final)
