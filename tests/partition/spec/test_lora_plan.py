"""LoRA in the planner: adapter counts by hand and against PEFT's published figure, the analytic profile of an
adapted model, and a plan's tiers and simulated step counting only the adapters as trainable."""

import dataclasses

import pytest

from partition.rules.tiers import HostBudget, place_tiers
from partition.search import make_plan
from partition.sim.stages import sim_stages
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import DeviceSpec
from partition.spec.lora import LoraShape, adapter_counts, adapter_kept, default_targets, frozen_layers
from partition.spec.models import MODELS, ModelSpec
from topology import cpu_standin

TINY = ModelSpec("tiny", num_blocks=2, d_model=8, num_heads=2, seq_len=4, vocab_size=16)
LLAMA = ModelSpec(
    "tiny-llama", num_blocks=3, d_model=12, num_heads=4, seq_len=5, vocab_size=31, family="llama", ffn_dim=7,
    num_kv_heads=2,
)  # fmt: skip
DEV = DeviceSpec("test-dev", peak_tflops=1.0, memory_bytes=1 << 30, pcie_gbps=10.0)


def test_llama2_7b_rank_16_on_q_and_v_has_pefts_published_count():
    # PEFT's print_trainable_parameters for Llama-2-7b, r=16, target_modules q_proj, v_proj: 8,388,608
    counts = adapter_counts(MODELS["llama2-7b"], LoraShape(16, ("q_proj", "v_proj")))
    assert sum(counts) == 8_388_608 and counts[0] == counts[-1] == 0


def test_counts_by_hand_for_odd_sizes():
    # llama block: q 12->12, k 12->6, v 12->6, o 12->12, gate/up 12->7, down 7->12; head 12->31
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    block = 3 * (24 + 18 + 18 + 24 + 19 + 19 + 19)
    assert adapter_counts(LLAMA, LoraShape(3, every)) == [0, block, block, block, 3 * 43]
    # gpt block: c_attn 8->24, attn.c_proj 8->8, c_fc 8->32, mlp.c_proj 32->8: "c_proj" names both
    assert adapter_counts(TINY, LoraShape(2, ("c_proj",))) == [0, 112, 112, 0]  # 2 * ((8 + 8) + (32 + 8))
    assert default_targets(LLAMA) == ("q_proj", "v_proj") and default_targets(TINY) == ("c_attn",)


def test_a_target_that_names_no_linear_layer_is_refused_with_the_names():
    with pytest.raises(ValueError, match=r"qkv name no linear layer of tiny-llama; its linear layers are "):
        adapter_counts(LLAMA, LoraShape(4, ("q_proj", "qkv")))


def test_the_analytic_profile_of_an_adapted_model():
    a = adapter_counts(TINY, LoraShape(2, ("c_attn",)))  # 2 * (8 + 24) = 64 per block
    plain = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp16", mfu=0.5)
    lora = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp16", mfu=0.5, adapters=a)
    for x, y, n in zip(plain.layers, lora.layers, a):
        assert (y.param_count, y.trainable_count, y.param_bytes) == (x.param_count + n, n, 2 * (x.param_count + n))
        tokens = 3 * 4
        assert y.fwd_flops == x.fwd_flops + 2 * tokens * n
        assert y.bwd_flops == x.fwd_flops + 4 * tokens * n  # no weight gradient of the base
        assert y.fwd_s == pytest.approx(y.fwd_flops / 5e11, rel=1e-12)
    assert plain.layers[1].trains == plain.layers[1].param_count and lora.layers[1].trains == 64
    with pytest.raises(ValueError, match="a count for each of the 4 layers"):
        analytic_profile(TINY, DEV, adapters=[0, 1])


def test_what_the_adapters_keep_by_hand():
    """A's output (r * e a token) per target and, with dropout, the dropped input and its mask ((e + m) * i: m the
    mask's bytes an element, e on the stand-in, 1 on a GPU); less each input of a linear layer nothing keeps once the
    base is frozen (e * i) and a frozen RMSNorm's normalized values (e * h)."""
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    # fp16, rank 3, h 12: 7 block targets (r * e = 6 each) keep every input; the two RMSNorms keep 2 * 2 * 12 less;
    # the head: lm_head's 6, its norm 24 less
    assert adapter_kept(LLAMA, LoraShape(3, every), 2, 2) == [0, 42 - 48, 42 - 48, 42 - 48, 6 - 24]
    # with dropout each target keeps its own dropped input and mask (inputs 12, six of them, and 7): + 2 * 2 * 79; the
    # inputs themselves (q/k/v's, gate/up's, down's: 12 + 12 + 7) are kept by nothing (o_proj's is SDPA's output)
    block = 42 + 2 * 2 * (6 * 12 + 7) - 2 * (12 + 12 + 7) - 48
    head = 6 + 2 * 2 * 12 - 2 * 12 - 24
    assert adapter_kept(LLAMA, LoraShape(3, every, dropout=0.05), 2, 2) == [0, block, block, block, head]
    gpu_block = 42 + (2 + 1) * (6 * 12 + 7) - 2 * (12 + 12 + 7) - 48  # a bool mask: one byte an element
    gpu_head = 6 + (2 + 1) * 12 - 2 * 12 - 24
    assert adapter_kept(LLAMA, LoraShape(3, every, dropout=0.05), 2, 1) == [
        0,
        gpu_block,
        gpu_block,
        gpu_block,
        gpu_head,
    ]
    a = adapter_counts(TINY, LoraShape(2, ("c_fc",)))
    # fp32, h 8, f 32: c_fc's 2 * 4 + 2 * 4 * 8 = 72; c_attn's, c_fc's (dropped) and mlp.c_proj's inputs nothing
    # keeps: 4 * (8 + 8 + 32); the head's lm_head input: 4 * 8
    kept = adapter_kept(TINY, LoraShape(2, ("c_fc",), dropout=0.1), 4, 4)
    assert kept == [0, 72 - 192, 72 - 192, -32]
    plain = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp32", adapters=a)
    lora = analytic_profile(TINY, DEV, microbatch_size=3, dtype="fp32", adapters=a, adapter_kept=kept)
    assert [y.activation_bytes - x.activation_bytes for x, y in zip(plain.layers, lora.layers)] == [
        0,
        -1440,
        -1440,
        -384,
    ]
    assert plain.layers[0].activation_bytes == 0  # the frozen embedding keeps nothing
    with pytest.raises(ValueError, match="adapter_kept: expected a count for each of the 4 layers, found 2"):
        analytic_profile(TINY, DEV, adapters=a, adapter_kept=[0, 1])
    with pytest.raises(ValueError, match=r"LoRA dropout: expected a probability in \[0, 1\), found 1"):
        LoraShape(2, ("c_fc",), dropout=1)


def _plans():
    spec = MODELS["gpt3-1.3b"]
    topo = cpu_standin(2, 64 << 30)
    a = adapter_counts(spec, LoraShape(8, ("c_attn", "c_proj")))
    plans = []
    for adapters in (None, a):
        profile = analytic_profile(spec, DEV, microbatch_size=1, dtype="bf16", adapters=adapters)
        plans.append(make_plan(profile, topo, 4, num_stages=4, solver="dp"))
    return plans, topo, a


def test_a_lora_plan_trains_the_adapters_alone():
    (full, lora), topo, a = _plans()
    assert [s.trainable_count for s in full.stages] == [None] * 4  # plans without LoRA say nothing new
    assert sum(s.trains for s in lora.stages) == sum(a)
    for s in lora.stages:
        assert s.gradient_bytes == 2 * s.trains and s.frozen_bytes == s.param_bytes - 2 * s.trains
    full_sim, lora_sim = sim_stages(full.stages, topo), sim_stages(lora.stages, topo)
    for s, x in zip(lora.stages, lora_sim):
        assert x.grad_bytes == s.gradient_bytes and x.update_s == pytest.approx(s.trains / 1e9)
    assert sum(x.update_s for x in lora_sim) < sum(x.update_s for x in full_sim) / 100


def _no_room_on_the_gpus(plan):
    """The plan with its gpus' usable memory cut to its walk: the adapters' states do not fit beside it."""
    from partition.rules.device_peak import planned_device_bytes

    return dataclasses.replace(plan, gpu_memory_bytes=max(planned_device_bytes(plan)) - plan.workspace_bytes)


def test_with_room_on_the_gpus_a_lora_plan_keeps_the_adapters_states_there():
    """The gpu tier: the adapters' master, moments, gradients and weights (16 bytes each) and their update's working
    memory on the gpus, no host state, no offload and no host update in the simulator; without the room, the host
    as before."""
    from partition.rules.placement import UPDATE_CHUNK, UPDATE_WORK_BYTES
    from partition.rules.tiers import states_fit_gpus

    (_, lora), topo, a = _plans()
    assert states_fit_gpus(lora)  # 64 GiB stand-in gpus
    mem = place_tiers(lora, HostBudget(None, "unlimited"))
    assert mem.to_dict()["tiers"] == {"optimizer": "device", "weights": "device", "frozen": "host"}
    assert mem.host_by_kind["optimizer"] == mem.host_by_kind["weights"] == 0 and mem.ssd_bytes == 0
    bare = place_tiers(_no_room_on_the_gpus(lora), HostBudget(None, "unlimited"))
    largest = [max(lora.stages[j].trains for j in lora.stages_of(g)) for g in range(lora.num_gpus)]
    work = UPDATE_WORK_BYTES * sum(min(n, UPDATE_CHUNK) for n in largest)  # each gpu: a chunk of its largest stage
    assert mem.device_bytes == bare.device_bytes + 16 * sum(a) + work
    sims = sim_stages(lora.stages, topo, mem)
    assert all(not x.offloads and x.update_s == 0.0 and x.offload_s == 0.0 for x in sims)
    assert not states_fit_gpus(_no_room_on_the_gpus(lora))


def test_a_lora_plans_tiers_keep_the_frozen_base_in_host_memory_and_states_for_the_adapters():
    (_, lora), _, a = _plans()
    lora = _no_room_on_the_gpus(lora)
    mem = place_tiers(lora, HostBudget(None, "unlimited"))
    frozen = sum(s.frozen_bytes for s in lora.stages)
    assert mem.host_by_kind["frozen"] == frozen > 0
    assert mem.host_by_kind["optimizer"] == 12 * sum(a)
    assert mem.host_by_kind["weights"] == 4 * sum(a)  # bf16 adapters and their gradients
    # a share that holds each gpu's frozen base and saved inputs but not all of its adapters' states
    share = max(g.frozen_bytes + g.saved_inputs_bytes for g in mem.gpus) + 16 * max(a) // 2
    tight = place_tiers(lora, HostBudget(2 * share, "test"))
    assert tight.host_by_kind["frozen"] == frozen and tight.ssd_by_kind["optimizer"] > 0
    assert [g.state_budget_bytes for g in tight.gpus] == [
        share - g.saved_inputs_bytes - g.frozen_bytes for g in tight.gpus
    ]


def test_the_baselines_under_lora_train_the_adapters_alone():
    """ZeRO-3 offload + LoRA reduce-scatters only the adapters' gradients and steps Adam over them; GPipe keeps
    16 bytes per trained parameter and the frozen ones in their dtype."""
    from partition.report.baselines import gpipe_stage_bytes, zero_offload
    from partition.rules.costmodel import LayerArrays

    spec, topo = MODELS["gpt3-1.3b"], cpu_standin(2, 64 << 30)
    a = adapter_counts(spec, LoraShape(8, ("c_attn", "c_proj")))
    full, lora = (analytic_profile(spec, DEV, dtype="bf16", adapters=x) for x in (None, a))
    base, adapted = zero_offload(full, topo, 4), zero_offload(lora, topo, 4)
    assert base.name == "DeepSpeed ZeRO-3 offload" and adapted.name == "DeepSpeed ZeRO-3 offload + LoRA"
    assert adapted.step_time_s is not None and base.step_time_s is not None
    assert adapted.step_time_s < base.step_time_s and "then CPU Adam 0.00 s" in adapted.notes[1]
    arr = LayerArrays.of(lora)
    n, t = arr.param_count(1, 3), arr.trainable(1, 3)
    assert gpipe_stage_bytes(arr, 1, 3, 0) == 16 * t + 2 * (n - t) + arr.activations(1, 3)


def test_a_quantized_base_counts_its_dequantized_weight_while_a_layer_computes():
    """X_l: dequantizing the layer's largest weight allocates it in the dtype (int8) and NF4's chunk of temporaries
    and its blocks' scales; the profile's X is the largest (llama2-70b: the head's 8192 x 32000)."""
    spec = MODELS["llama2-70b"]
    a = adapter_counts(spec, LoraShape(16, ("q_proj", "v_proj")))
    mlp, head = 8192 * 28672, 8192 * 32000
    plain = dataclasses.replace(DEV, holds_transients=False, library_bytes=0)  # the dequantization's X alone
    for base_dtype, e, x in (("nf4", 2, lambda n: 2 * n + 4 * (n // 64) + 4 * (1 << 20)), ("int8", 4, lambda n: 4 * n)):
        frozen = frozen_layers(spec, e, base_dtype)
        assert frozen.dequantized == (0,) + (x(mlp),) * 80 + (x(head),)
        dtype = "bf16" if e == 2 else "fp32"
        p = analytic_profile(spec, plain, dtype=dtype, adapters=a, frozen=frozen)
        assert [y.workspace_bytes for y in p.layers] == list(frozen.dequantized)
        assert max(y.workspace_bytes for y in p.layers) == x(head)
        # on a device that holds transients, the dequantized weight lies beside a linear's gradients: the layer's X
        # is at least each of the two, at most their sum
        dense, both = (analytic_profile(spec, DEV, dtype=dtype, adapters=a, frozen=z) for z in (None, frozen))
        for d, q, y in zip(dense.layers, frozen.dequantized, both.layers):
            assert max(d.workspace_bytes, q) <= y.workspace_bytes <= d.workspace_bytes + q
        assert any(y.workspace_bytes > d.workspace_bytes for d, y in zip(dense.layers, both.layers))
    dense = analytic_profile(spec, plain, dtype="bf16", adapters=a)
    assert {y.workspace_bytes for y in dense.layers} == {0}  # a dense base: no X
