"""A quantized base (QLoRA's NF4, weight-only int8): the weights dequantize to torchao's bit for bit, a Pipeline with
a quantized base trains as peft does on a model whose base weights are torchao's dequantized ones (the bytes through
the stage's frozen slot unchanged), the weight slot holds well under half of the fp32 base's bytes, and the run
stays near the dense one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobiuspipe import LoraSpec
from mobiuspipe.lora.quant import Int8Linear, NF4Linear, quantizable
from mobiuspipe.models.hf import hf_key, open_hf
from partition.rules.costmodel import FROZEN_ALIGN
from partition.spec.lora import int8_bytes, int8_numel, nf4_bytes, nf4_numel

peft = pytest.importorskip("peft")
nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
int8_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
PerRow = pytest.importorskip("torchao.quantization.granularity").PerRow

SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
"""NF4: q, o, gate, up and down (multiples of 16,384 weights); k and v (8,192) and the head stay dense. int8: every
linear layer, the head too."""
TARGETS = ("q_proj", "v_proj", "down_proj")


def _base(conv1d: bool, i: int = 256, o: int = 128) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A linear layer (nn.Linear or GPT-2's Conv1D) of i -> o features, its weight and its bias."""
    base = nn.Linear(i, o, bias=True)
    if conv1d:
        from transformers.pytorch_utils import Conv1D

        conv = Conv1D(o, i)  # weight [in, out]
        conv.weight.data.copy_(base.weight.data.T)
        conv.bias.data.copy_(base.bias.data)
        base = conv
    return base, base.get_parameter("weight"), base.get_parameter("bias")


@pytest.mark.parametrize("conv1d", [False, True])
def test_an_nf4_layer_is_torchaos_nf4_bit_for_bit(conv1d):
    torch.manual_seed(0)
    base, weight, bias = _base(conv1d)
    q = NF4Linear(base)
    want = nf4_tensor.to_nf4(weight.detach().bfloat16(), 64, 256).get_original_weight()
    assert torch.equal(q.weight(), want) and q.weight().dtype == torch.bfloat16
    codes = [p for n, p in q.named_parameters() if n != "bias"]
    assert sum(p.nbytes for p in codes) == nf4_bytes(weight.numel())  # the planner's count (partition)
    assert sum(p.numel() for p in codes) == nf4_numel(weight.numel())
    x = torch.randn(3, 5, 256)
    dense = want.float()
    ref = (x @ dense if conv1d else torch.nn.functional.linear(x, dense)) + bias
    assert torch.equal(q(x), ref)
    xg = x.clone().requires_grad_(True)  # the backward dequantizes again: the input gradient of the dense layer
    q(xg).sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, (torch.ones(3, 5, 128) @ (dense.t() if conv1d else dense)))


@pytest.mark.parametrize(("conv1d", "dtype"), [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_an_int8_layer_is_torchaos_int8_bit_for_bit(conv1d, dtype):
    """Odd sizes (int8 takes every linear weight); a Conv1D's weight is quantized as [out, in]."""
    torch.manual_seed(1)
    base, weight, bias = _base(conv1d, 37, 19)
    q = Int8Linear(base.to(dtype))
    w = weight.detach().bfloat16()
    ref = int8_tensor.Int8Tensor.from_hp(w.t().contiguous() if conv1d else w, PerRow()).dequantize(dtype)
    assert torch.equal(q.weight(dtype), ref) and ref.shape == (19, 37)
    codes = [p for n, p in q.named_parameters() if n != "bias"]
    assert sum(p.nbytes for p in codes) == int8_bytes(37, 19)  # the planner's count (partition)
    assert sum(p.numel() for p in codes) == int8_numel(37, 19)
    x = torch.randn(3, 5, 37, dtype=dtype)
    assert torch.equal(q(x), torch.nn.functional.linear(x, ref) + bias)
    xg = x.clone().requires_grad_(True)
    q(xg).sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, torch.ones(3, 5, 19, dtype=dtype) @ ref)


def _nf4_dequantized(name: str, w: torch.Tensor) -> torch.Tensor | None:
    if name == "lm_head" or not quantizable(w):
        return None
    return nf4_tensor.to_nf4(w.bfloat16(), 64, 256).get_original_weight().float()


def _int8_dequantized(name: str, w: torch.Tensor) -> torch.Tensor:
    return int8_tensor.Int8Tensor.from_hp(w.bfloat16(), PerRow()).dequantize(torch.float32)


DEQUANTIZED = {"nf4": _nf4_dequantized, "int8": _int8_dequantized}
"""base_dtype -> a linear layer's weight (fp32) as the Pipeline computes with it in fp32, or None: left dense."""


def _dequantized_base(folder, base_dtype):
    """The transformers model whose linear weights are torchao's quantized ones, dequantized (DEQUANTIZED)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            w = DEQUANTIZED[base_dtype](name, mod.weight)
            if w is not None:
                mod.weight.copy_(w)
    return model


@pytest.mark.parametrize(
    ("base_dtype", "kinds", "distance"),
    [("nf4", {"qdata", "qscalers", "qfactor", "qmean", "weight"}, 1e-2), ("int8", {"qdata", "qscale"}, 1e-3)],
)
def test_a_quantized_base_trains_as_peft_on_its_dequantized_weights(tmp_path, hf_kit, base_dtype, kinds, distance):
    hf_kit.save_model("llama", tmp_path / "base", seed=4, **SIZES)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS, base_dtype=base_dtype)
    batches = hf_kit.random_batches(3, 8, 13, seed=5)
    with hf_kit.lora_pipeline(m, spec, batches) as pipe:
        before = pipe.state_dict(frozen=False)
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        slot = max(s.weight_nbytes for s in pipe.stages.values())
        found = {f.name.rsplit(".", 1)[-1] for s in pipe.stages.values() for f in s.frozen}
    assert kinds <= found  # NF4 and dense frozen weights together; int8 in every linear layer
    config = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS))
    ref = peft.get_peft_model(_dequantized_base(tmp_path / "base", base_dtype), config)
    start = {f"base_model.model.{hf_key(m, int(k.split('.')[0]), k.split('.', 1)[1])}": t for k, t in before.items()}
    assert not peft.set_peft_model_state_dict(ref, start).unexpected_keys
    want = hf_kit.train_plain(ref, batches, microbatches=4, lr=5e-3)
    assert got == pytest.approx(want, rel=1e-5), (got, want)

    dense = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    with hf_kit.lora_pipeline(m, dense, batches) as pipe:
        plain = [pipe.train_batch(x, y).loss for x, y in batches]
        dense_slot = max(s.weight_nbytes for s in pipe.stages.values())
    # the documented distance: the rounding moves each step's loss by under 1% (NF4), 0.1% (int8) of the dense base's
    # here (measured: 0.06%, 0.01%)
    assert got == pytest.approx(plain, rel=distance) and got != plain
    assert slot < 0.5 * dense_slot  # fp32 dense against the codes (measured: 0.40 NF4, 0.42 int8 beside the adapters)


@pytest.mark.parametrize(
    ("precision", "base_dtype", "rank", "sizes"),
    [
        ("fp32", "nf4", 4, SIZES),
        ("bf16", "nf4", 4, SIZES),
        ("bf16", "int8", 4, SIZES),
        ("bf16", "int8", 3, {**SIZES, "intermediate_size": 255}),  # odd adapter counts: the int32 scales at an offset
    ],
)
def test_a_quantized_run_resumes_bit_for_bit(tmp_path, hf_kit, precision, base_dtype, rank, sizes):
    """The checkpoint holds the adapters; the base is quantized again from the model folder, the same bytes. With an
    odd count of bf16 adapter weights the frozen items still start where their int32 scales can be viewed in place
    (FROZEN_ALIGN), inside the slot the plan counted."""
    hf_kit.save_model("llama", tmp_path / "base", seed=2, **sizes)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=rank, alpha=8.0, targets=TARGETS, base_dtype=base_dtype)
    batches = hf_kit.random_batches(4, 8, 13, seed=3)
    torch.manual_seed(1)
    with hf_kit.lora_pipeline(m, spec, batches, precision) as pipe:
        straight = [pipe.train_batch(x, y).loss for x, y in batches]
        final = pipe.state_dict(frozen=False)
        stages = list(pipe.stages.values())
        assert all(s.frozen_start % FROZEN_ALIGN == 0 and s.weight_nbytes <= pipe.plan.slot_bytes for s in stages)
        assert any(s.frozen_start > s.nbytes for s in stages) == (rank % 2 == 1)
        plan = pipe.plan  # one cut for the three runs (a plan from a profile may cut elsewhere on a busy machine)
    torch.manual_seed(1)
    with hf_kit.lora_pipeline(m, spec, batches, precision, plan=plan) as pipe:
        first = [pipe.train_batch(x, y).loss for x, y in batches[:2]]
        folder = pipe.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(7)  # another seed: the adapters come from the checkpoint
    with hf_kit.lora_pipeline(m, spec, batches, precision, plan=plan) as pipe:
        assert pipe.load_checkpoint(folder) == 2
        rest = [pipe.train_batch(x, y).loss for x, y in batches[2:]]
        resumed = pipe.state_dict(frozen=False)
    assert first + rest == straight
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[k], final[k]) for k in final)
