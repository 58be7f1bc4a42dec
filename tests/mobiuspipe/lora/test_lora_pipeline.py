"""Pipeline(lora=...): the adapters train and the base stays frozen, equal to peft + torch AdamW on the same
batches (a tiny Llama and GPT-2, 3 stages on one rank, recompute and keep); the frozen weights get no gradient,
no optimizer state and are loaded read-only: every one of them ends bit for bit as it began."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe import LoraSpec, Pipeline
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import hf_key, layer_factories, open_hf

peft = pytest.importorskip("peft")

TARGETS = {"llama": ("q_proj", "v_proj", "up_proj", "down_proj"), "gpt2": ("c_attn", "c_proj")}


@pytest.mark.parametrize("kind,activations", [("llama", "recompute"), ("llama", "keep"), ("gpt2", "recompute")])
def test_lora_pipeline_trains_as_peft_does(tmp_path, hf_kit, kind, activations):

    hf_kit.save_model(kind, tmp_path / "base", seed=6)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS[kind])
    batches = hf_kit.random_batches(3, 8, 13, seed=8)
    with hf_kit.lora_pipeline(
        m, spec, batches, activations=activations, weight_decay=0.01, tied=m.tied_params()
    ) as pipe:
        before = pipe.state_dict()
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        after = pipe.state_dict()
        trained = {n for s in pipe.stages.values() for n in s.trainable_keys()}
        # the arena's gradient slot holds the adapters' gradients alone: 2 weight slots and a small one
        plan, arena = pipe.plan, pipe.engine.arena
        assert plan.grad_slot_bytes == max(s.gradient_bytes for s in plan.stages) < plan.slot_bytes / 4
        assert plan.arena_bytes == 2 * plan.slot_bytes + plan.grad_slot_bytes
        assert (
            arena.grad_slot_bytes is not None and max(s.nbytes for s in pipe.stages.values()) <= arena.grad_slot_bytes
        )

    ref, want = _peft_run(tmp_path / "base", m, kind, spec, before, trained, batches, hf_kit)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    ref_after = peft.get_peft_model_state_dict(ref)
    for k in trained:
        l, name = int(k.split(".")[0]), k.split(".", 1)[1]
        torch.testing.assert_close(after[k], ref_after[f"base_model.model.{hf_key(m, l, name)}"], rtol=1e-4, atol=1e-6)
    assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained)
    frozen = [k for k in before if k not in trained]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)  # not one bit of the base moved


def _peft_run(folder, m, kind, spec, before, trained, batches, hf_kit):
    """peft's model of the base in `folder` started from the Pipeline's adapters (`before`, keys in `trained`),
    trained by torch AdamW on the same batches: (the model, its losses)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    ref = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(spec.targets), fan_in_fan_out=kind == "gpt2")
    )
    start = {
        f"base_model.model.{hf_key(m, int(k.split('.')[0]), k.split('.', 1)[1])}": t
        for k, t in before.items()
        if k in trained and ".lora_" in k
    }
    assert not peft.set_peft_model_state_dict(ref, start).unexpected_keys
    return ref, hf_kit.train_plain(ref, batches, microbatches=4, lr=5e-3, weight_decay=0.01)


def test_a_mutant_that_also_trains_a_frozen_weight_fails_the_comparison(tmp_path, hf_kit, monkeypatch):
    """The comparison above catches a runtime that also updates a weight of the base: here every layer's norm
    weights train beside the adapters, and the losses leave peft's after the first update."""
    from mobiuspipe.lora import layers as lora_layers

    real = lora_layers.add_adapters

    def mutant(layer, spec, *args, **kwargs):
        real(layer, spec, *args, **kwargs)
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.requires_grad_(True)

    monkeypatch.setattr(lora_layers, "add_adapters", mutant)
    hf_kit.save_model("llama", tmp_path / "base", seed=6)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS["llama"])
    batches = hf_kit.random_batches(3, 8, 13, seed=8)
    with hf_kit.lora_pipeline(m, spec, batches, weight_decay=0.01) as pipe:
        before = pipe.state_dict()
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        trained = {n for s in pipe.stages.values() for n in s.trainable_keys()}
    assert any(k.endswith("norm.weight") for k in trained)  # the mutant did train a base weight
    _, want = _peft_run(tmp_path / "base", m, "llama", spec, before, trained, batches, hf_kit)
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got != pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_bit_for_bit(tmp_path, hf_kit, precision):
    hf_kit.save_model("llama", tmp_path / "base", seed=7)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "o_proj"))
    batches = hf_kit.random_batches(4, 8, 13, seed=10)
    torch.manual_seed(3)
    with hf_kit.lora_pipeline(m, spec, batches, precision) as pipe:
        straight = [pipe.train_batch(x, y).loss for x, y in batches]
        final = pipe.state_dict()
        adapters = sum(p.numel for s in pipe.stages.values() for p in s.params)
        frozen = sum(f.nbytes for s in pipe.stages.values() for f in s.frozen)
        plan = pipe.plan  # one cut for the three runs (a plan from a profile may cut elsewhere on a busy machine)
    torch.manual_seed(3)
    with hf_kit.lora_pipeline(m, spec, batches, precision, plan=plan) as pipe:
        first = [pipe.train_batch(x, y).loss for x, y in batches[:2]]
        folder = pipe.save_checkpoint(tmp_path / "ck")
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    # the adapters' master, moments and low-precision copy and the plan; any base tensor would add its bytes
    assert written < 16 * adapters + 12 * 1024 < frozen
    torch.manual_seed(99)  # another seed: the adapters come from the checkpoint
    with hf_kit.lora_pipeline(m, spec, batches, precision, plan=plan) as pipe:
        assert pipe.load_checkpoint(folder) == 2
        rest = [pipe.train_batch(x, y).loss for x, y in batches[2:]]
        resumed = pipe.state_dict()
    assert first + rest == straight
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[k], final[k]) for k in final)


def test_the_trained_adapter_exports_to_a_folder_peft_loads(tmp_path, hf_kit):
    from transformers import AutoModelForCausalLM

    from mobiuspipe.lora.peft_format import save_adapter
    from mobiuspipe.models.hf_export import adapter_tensors

    hf_kit.save_model("gpt2", tmp_path / "base", seed=9)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=3, alpha=6.0, targets=("c_attn", "c_fc"))
    batches = hf_kit.random_batches(3, 8, 13, seed=11)
    with hf_kit.lora_pipeline(m, spec, batches) as pipe:
        for x, y in batches[:2]:
            pipe.train_batch(x, y)
        held_out = pipe.eval_batch(*batches[2])
        tensors = adapter_tensors(m, pipe.state_dict())
    assert tensors and all(".lora_" in k and k.startswith("transformer.h.") for k in tensors)
    save_adapter(tmp_path / "adapter", spec, tensors, str(tmp_path / "base"), fan_in_fan_out=True)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="sdpa")
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert float(lm_loss(loaded(batches[2][0]).logits, batches[2][1])) == pytest.approx(held_out, rel=1e-5)


def test_a_plan_of_the_model_alone_is_refused_naming_the_adapters(tmp_path, hf_kit):
    from mobiuspipe.errors import PipelineError

    hf_kit.save_model("llama", tmp_path / "base", seed=1)
    m = open_hf(tmp_path / "base", 13)
    batches = hf_kit.random_batches(1, 8, 13)
    with Pipeline(layer_factories(m), lm_loss, sample=batches[0], num_microbatches=4, num_stages=3) as pipe:
        plan = pipe.plan
    with pytest.raises(
        PipelineError,
        match=r"\(\d+ trainable beside \d+ frozen: with LoRA, the adapters, which a plan of the model alone",
    ):
        Pipeline(layer_factories(m), lm_loss, plan=plan, lora=LoraSpec(rank=2, alpha=2.0, targets=("q_proj",)))


def test_adapters_on_ssd_train_bit_for_bit_as_on_host(tmp_path, hf_kit):
    """The adapters' states take the tiers memory= gives them (here every stage's on SSD, weights too); the
    frozen base stays in host memory either way."""
    from mobiuspipe.config import MemoryConfig

    hf_kit.save_model("llama", tmp_path / "base", seed=12)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "gate_proj"))
    batches = hf_kit.random_batches(3, 8, 13, seed=13)
    ssd = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path / "ssd"), host_budget_mb=4)
    runs = {}
    for name, memory in (("host", None), ("ssd", ssd)):
        torch.manual_seed(5)
        with hf_kit.lora_pipeline(m, spec, batches, memory=memory) as pipe:
            runs[name] = ([pipe.train_batch(x, y).loss for x, y in batches], pipe.state_dict(), dict(pipe.state_tiers))
    assert set(runs["ssd"][2].values()) == {("ssd", "ssd")}
    assert runs["ssd"][0] == runs["host"][0]
    assert all(torch.equal(runs["ssd"][1][k], runs["host"][1][k]) for k in runs["host"][1])


def _count_store_writes(monkeypatch) -> list[tuple[str, int]]:
    """(key, bytes) of every write to an SSD store from now on, in order."""
    from mobiuspipe.memory.store.ssd_store import SSDStore

    writes: list[tuple[str, int]] = []
    real = SSDStore.put_async

    def counted(self, key, t):
        writes.append((key, t.nbytes))
        return real(self, key, t)

    monkeypatch.setattr(SSDStore, "put_async", counted)
    return writes


@pytest.mark.parametrize("base_dtype", [None, "int8"])
def test_a_frozen_base_on_ssd_trains_bit_for_bit_as_in_host_memory(tmp_path, hf_kit, base_dtype, monkeypatch):
    """memory.frozen ssd: each stage's frozen bytes (the training dtype's, or int8 codes and int32 scales) are
    records in the rank's store, streamed into the weight slot at each LOAD; the same losses and weights, bit for
    bit, beside adapters in host memory or on the SSD."""
    from mobiuspipe.config import MemoryConfig
    from mobiuspipe.runtime.frozen import SsdFrozenWeights

    hf_kit.save_model("llama", tmp_path / "base", seed=14)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "down_proj"), base_dtype=base_dtype)
    batches = hf_kit.random_batches(3, 8, 13, seed=15)
    frozen = MemoryConfig(frozen="ssd", ssd_dir=str(tmp_path / "ssd"))
    every = MemoryConfig(optimizer="ssd", weights="ssd", frozen="ssd", ssd_dir=str(tmp_path / "ssd2"), host_budget_mb=4)
    runs, writes = {}, _count_store_writes(monkeypatch)
    for name, memory in (("host", None), ("frozen", frozen), ("every", every)):
        writes.clear()
        torch.manual_seed(5)
        with hf_kit.lora_pipeline(m, spec, batches, memory=memory) as pipe:
            on_ssd = [isinstance(s.frozen_weights, SsdFrozenWeights) for s in pipe.stages.values()]
            at_start = len(writes)
            assert any("/frozen/" in key for key, _ in writes) == bool(memory)  # written once, as the stages build
            runs[name] = ([pipe.train_batch(x, y).loss for x, y in batches], pipe.state_dict())
            trains = sum(s.numel for s in pipe.stages.values())
            stepped = writes[at_start:]
        assert all(on_ssd) if memory else not any(on_ssd)
        # nothing is written for the frozen base once the run has started: the steps write the adapters' states
        # (fp32 master and moments, weights and gradients: 20 bytes each) and their records' 4 KiB padding alone
        assert not any("/frozen/" in key for key, _ in stepped)
        assert sum(n for _, n in stepped) <= len(batches) * (20 * trains + 5 * 4096 * len(pipe.stages))
        if name == "every":
            assert stepped
    for name in ("frozen", "every"):
        assert runs[name][0] == runs["host"][0]
        assert runs[name][1].keys() == runs["host"][1].keys()  # the frozen weights too, read back from the SSD
        assert all(torch.equal(runs[name][1][k], runs["host"][1][k]) for k in runs["host"][1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adapter_states_on_the_gpu_train_as_peft_and_resume_bit_for_bit(tmp_path, hf_kit, precision):
    """memory.optimizer device: the adapters' master, moments, gradients (and bf16 weights) are gpu tensors (the
    strict stand-in's), counted by the ledger, stepped by torch's AdamW there: nothing is offloaded. fp32 trains as
    peft + AdamW does (1e-5); a checkpoint resumes bit for bit."""
    from mobiuspipe.config import MemoryConfig
    from mobiuspipe.runtime.states import DeviceStates
    from mobiuspipe.standin.places import gpu_of

    hf_kit.save_model("llama", tmp_path / "base", seed=6)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS["llama"])
    batches = hf_kit.random_batches(4, 8, 13, seed=8)
    device = MemoryConfig(optimizer="device")
    torch.manual_seed(3)
    with hf_kit.lora_pipeline(m, spec, batches, precision, memory=device, weight_decay=0.01) as pipe:
        states = [s.states for s in pipe.stages.values()]
        assert all(isinstance(s, DeviceStates) for s in states)
        assert all(gpu_of(t) == 0 for s in states for t in s.tensors().values())  # MOBIUSPIPE_STRICT marks them
        held = sum(t.nbytes for s in states for t in s.tensors().values())
        assert pipe.engine.ledger.parts()["states"] == held
        before = pipe.state_dict()
        trained = {n for s in pipe.stages.values() for n in s.trainable_keys()}
        straight = [pipe.train_batch(x, y).loss for x, y in batches]
        final = pipe.state_dict(frozen=False)
        peak, parts, _ = pipe.device_peak()
        assert parts["states"] == held and peak <= pipe.planned_device_bytes()[0]  # the plan's walk counts them
        plan = pipe.plan  # one cut for the three runs (a plan from a profile may cut elsewhere on a busy machine)
    if precision == "fp32":
        _, want = _peft_run(tmp_path / "base", m, "llama", spec, before, trained, batches, hf_kit)
        assert straight == pytest.approx(want, rel=1e-5), (straight, want)
    torch.manual_seed(3)
    with hf_kit.lora_pipeline(m, spec, batches, precision, memory=device, weight_decay=0.01, plan=plan) as pipe:
        first = [pipe.train_batch(x, y).loss for x, y in batches[:2]]
        folder = pipe.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(9)
    with hf_kit.lora_pipeline(m, spec, batches, precision, memory=device, weight_decay=0.01, plan=plan) as pipe:
        assert pipe.load_checkpoint(folder) == 2
        rest = [pipe.train_batch(x, y).loss for x, y in batches[2:]]
        resumed = pipe.state_dict(frozen=False)
    assert first + rest == straight
    assert all(torch.equal(resumed[k], final[k]) for k in final)


def test_adapter_states_on_the_gpu_speculate_to_the_held_updates_bits(tmp_path, hf_kit):
    """memory.optimizer device with clipping that triggers on some steps: a tentative update is a note until the
    step's norm is known, kept or forgotten then; the run equals the one whose updates wait, bit for bit."""
    from mobiuspipe.config import MemoryConfig

    hf_kit.save_model("llama", tmp_path / "base", seed=6)
    m = open_hf(tmp_path / "base", 13)
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS["llama"])
    batches = hf_kit.random_batches(4, 8, 13, seed=8)

    def run(speculative: bool, clip: float):
        torch.manual_seed(3)
        memory = MemoryConfig(optimizer="device")
        with hf_kit.lora_pipeline(
            m, spec, batches, "bf16", memory=memory, max_grad_norm=clip, speculative_update=speculative
        ) as pipe:
            steps = [pipe.train_batch(x, y) for x, y in batches]
            return [(r.loss, r.grad_norm, r.updates_rolled_back) for r in steps], pipe.state_dict(frozen=False)

    norms = sorted(n or 0.0 for _, n, _ in run(False, 1e9)[0])
    clip = (norms[1] + norms[2]) / 2  # two steps clip, two do not
    (held, held_w), (spec_steps, spec_w) = run(False, clip), run(True, clip)
    assert [s[:2] for s in spec_steps] == [s[:2] for s in held]
    clipped = [(n or 0.0) > clip for _, n, _ in held]
    assert [r > 0 for *_, r in spec_steps] == [c and (s == 0 or not clipped[s - 1]) for s, c in enumerate(clipped)]
    assert all(torch.equal(spec_w[k], held_w[k]) for k in held_w)
