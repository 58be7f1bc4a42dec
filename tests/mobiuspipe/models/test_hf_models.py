"""Hugging Face models cut into layers: the same logits as transformers, layer by layer loading, training
through the Pipeline equal to transformers + AdamW (tied embeddings included), export, bad folders."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.errors import ConfigError
from mobiuspipe.models import hf_weights
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import SUPPORTED, hf_key, layer_factories, open_hf
from mobiuspipe.models.hf_export import MARKER, check_export_dir, finish_export, partial_dir, write_shard
from mobiuspipe.optim import CPUAdam
from partition.spec.hf import ModelConfigError

VOCAB = 301  # hf_fixtures.VOCAB
KINDS = ("gpt2", "llama", "mistral", "qwen2")


def _logits(layers, x):
    with torch.no_grad():
        return nn.Sequential(*layers).eval()(x)


@pytest.mark.parametrize("kind", KINDS)
def test_layers_give_transformers_logits(tmp_path, hf_kit, kind):
    model = hf_kit.save_model(kind, tmp_path / kind, seed=3).eval()
    m = open_hf(tmp_path / kind, 19)
    x = torch.randint(0, VOCAB, (3, 19))
    with torch.no_grad():
        want = model(x).logits
    got = _logits([f() for f in layer_factories(m)], x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert sum(p.numel() for f in layer_factories(m) for p in f().parameters()) == m.spec.param_count
    assert (m.tied_params() != []) == (kind in ("gpt2", "qwen2"))


def test_each_layer_reads_only_its_tensors_from_shards(tmp_path, hf_kit, monkeypatch):
    model = hf_kit.save_model("llama", tmp_path / "m").eval()
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf_weights.INDEX).is_file()
    m = open_hf(tmp_path / "sharded", 16)
    read: list[str] = []
    real = hf_weights.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(hf_weights, "safe_open", Recording)
    layers = []
    for l, make in enumerate(layer_factories(m)):
        read.clear()
        layers.append(make())
        prefix = {0: "model.embed_tokens.", m.num_layers - 1: ""}.get(l, f"model.layers.{l - 1}.")
        assert read and all(k.startswith(prefix) or k in ("model.norm.weight", "lm_head.weight") for k in read)
        assert len(read) == len(list(layers[-1].parameters()))
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(_logits(layers, x), model(x).logits, rtol=0, atol=1e-6)


def test_gpt2_checkpoint_without_the_base_prefix(tmp_path, hf_kit):
    """GPT-2's original checkpoint names tensors "h.0...." (no "transformer."), and stores no lm_head."""
    model = hf_kit.save_model("gpt2", tmp_path / "m").eval()
    bare = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "m" / "model.safetensors").items()}
    bare.pop("lm_head.weight", None)
    save_file(bare, str(tmp_path / "m" / "model.safetensors"))
    m = open_hf(tmp_path / "m", 16)
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(_logits([f() for f in layer_factories(m)], x), model(x).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_training_equals_transformers_and_export_loads(tmp_path, hf_kit, kind):
    """One rank, 3 stages (the tied embedding's halves in stages 0 and 2): losses within 1e-5 relative of
    transformers + AdamW, and the exported folder loads with from_pretrained giving the same logits."""
    from transformers import AutoModelForCausalLM

    model = hf_kit.save_model(kind, tmp_path / "src", seed=5)
    m = open_hf(tmp_path / "src", 13)
    batches = hf_kit.random_batches(4, 8, 13, seed=7)
    want = hf_kit.train_plain(model, batches, microbatches=4, lr=3e-3)
    opt = partial(CPUAdam, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with Pipeline(
        layer_factories(m),
        lm_loss,
        sample=batches[0],
        num_microbatches=4,
        num_stages=3,
        optimizer=opt,
        tied=m.tied_params(),
    ) as pipe:
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        weights = pipe.stage_state_dicts()
    assert max(abs(a - b) / abs(a) for a, b in zip(want, got)) < 1e-5, (want, got)
    for a, b in m.tied_params():
        assert torch.equal(pipe.state_dict()[a], pipe.state_dict()[b])  # the halves stayed one parameter
    to = tmp_path / "export"
    shards = {j: write_shard(m, j, 3, w, partial_dir(to), torch.float32) for j, w in weights.items()}
    finish_export(m, shards, 3, to, torch.float32, "owner")
    back = AutoModelForCausalLM.from_pretrained(str(to), attn_implementation="sdpa").eval()
    x = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model.eval()(x).logits, rtol=1e-4, atol=1e-4)
    index = json.loads((to / hf_weights.INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"] or not m.tied


def test_missing_config_or_weights(tmp_path, hf_kit):
    with pytest.raises(ModelConfigError, match="has no config.json"):
        open_hf(tmp_path, 16)
    hf_kit.save_model("llama", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelConfigError, match=r"no model.safetensors.*found: pytorch_model.bin.*save_pretrained"):
        open_hf(tmp_path / "m", 16)


def test_unsupported_architecture_is_named_with_the_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelConfigError) as e:
        open_hf(tmp_path, 16)
    assert "'bert' is not supported" in str(e.value)
    assert all(k in str(e.value) for k in SUPPORTED)


def test_sequence_longer_than_positions_or_window(tmp_path, hf_kit):
    hf_kit.save_model("gpt2", tmp_path / "g")
    with pytest.raises(ModelConfigError, match="model.seq_len 49 exceeds the model's 48 positions"):
        open_hf(tmp_path / "g", 49)
    hf_kit.save_model("mistral", tmp_path / "w", sliding_window=16)
    with pytest.raises(ModelConfigError, match="sliding-window attention over 16 tokens"):
        open_hf(tmp_path / "w", 17)


def test_open_hf_names_every_missing_or_misshapen_tensor_from_the_headers(tmp_path, hf_kit):
    """Before any weight is read: each tensor config.json implies, by name and shape, all problems at once."""
    hf_kit.save_model("llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 38}))
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelConfigError) as e:
        open_hf(tmp_path / "m", 16)
    blocks = cfg["num_hidden_layers"]
    assert "1 tensor(s) missing: 'model.norm.weight' (layer" in str(e.value)
    assert (
        f"{3 * blocks} of another shape: 'model.layers.0.mlp.gate_proj.weight' of shape (37, 24) for (38, 24)"
        in str(e.value)
    )


def test_a_truncated_safetensors_file_is_named(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "m")
    single = tmp_path / "m" / "model.safetensors"
    single.write_bytes(single.read_bytes()[:-100])
    with pytest.raises(ModelConfigError, match=r"model.safetensors is not a readable safetensors file .*copy it again"):
        open_hf(tmp_path / "m", 16)
    hf_kit.save_model("llama", tmp_path / "m2").save_pretrained(str(tmp_path / "s"), max_shard_size="20KB")
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ModelConfigError, match=rf"1 unreadable file\(s\): {shard.name} \(Error while deserializing"):
        open_hf(tmp_path / "s", 16)


def test_a_checkpoint_changed_after_the_check_fails_on_load(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "m")
    m = open_hf(tmp_path / "m", 16)
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    tensors.pop("model.norm.weight")
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"of shape \(36, 24\), config.json implies \(37, 24\)"):
        layer_factories(m)[1]()
    with pytest.raises(ModelConfigError, match=r"cannot read 'model.norm.weight' from model.safetensors .*copy"):
        layer_factories(m)[-1]()


@pytest.mark.parametrize("kind,passes", [("gpt2", 2), ("qwen2", 2), ("gpt2", 1)])
def test_clipping_and_accumulation_equal_transformers(tmp_path, hf_kit, kind, passes):
    """Two accumulation passes of 3 microbatches (or one pass of 6: its norm reduced on the gpu before each
    offload) and a global norm clip (a tied pair counted once) equal transformers with the 6 microbatches
    accumulated and clip_grad_norm_; the norms reported match its."""
    model = hf_kit.save_model(kind, tmp_path / "src", seed=8)
    m = open_hf(tmp_path / "src", 9)
    batches = hf_kit.random_batches(3, 12, 9, seed=3)
    want, want_norms = hf_kit.train_plain(model, batches, microbatches=6, lr=1e-2, max_norm=0.3)
    with _clipped_pipeline(m, batches, passes=passes) as pipe:
        pass_times, peaks = _record_passes(pipe.engine)
        results = [pipe.train_batch(x, y) for x, y in batches]
    assert [r.loss for r in results] == pytest.approx(want, rel=1e-5)
    assert [r.grad_norm for r in results] == pytest.approx(want_norms, rel=1e-5)
    assert all(n > 0.3 for n in want_norms)  # every step clipped
    for k, r in enumerate(results):  # this rank's own figures cover both passes of the step
        times = pass_times[passes * k : passes * (k + 1)]
        assert r.own_times.compute_s == sum(t.compute_s for t in times) and r.own_times.compute_s > 0
        assert r.own_times.comm_s == sum(t.comm_s for t in times)
        assert r.own_device_peak_bytes == peaks[k] == r.device_peak_bytes  # the step's; one rank: its own is the max


def _clipped_pipeline(m, batches, memory=None, passes=2) -> Pipeline:
    """m's layers in 3 stages, 6 microbatches of 2 sequences a step in `passes` accumulation passes, clipped to 0.3,
    CPUAdam at transformers' reference settings (hf_kit.train_plain with lr 1e-2), tied as m ties them."""
    opt = partial(CPUAdam, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    per_pass = 12 // passes
    return Pipeline(
        layer_factories(m),
        lm_loss,
        sample=(batches[0][0][:per_pass], batches[0][1][:per_pass]),
        num_microbatches=6 // passes,
        num_stages=3,
        optimizer=opt,
        tied=m.tied_params(),
        accumulation_steps=passes,
        max_grad_norm=0.3,
        memory=memory,
    )


def _record_passes(engine) -> tuple[list, list]:
    """Wrap engine.run_step and end_step: the lists they return get each pipeline pass's times (the stand-in's, from
    the pass's state) and each step's measured device peak."""
    times, peaks = [], []
    run, end = engine.run_step, engine.end_step

    def ran(*args):
        run(*args)
        times.append(engine.state.times)

    def ended():
        out = end()
        peaks.append(engine.peak.step_bytes)
        return out

    engine.run_step, engine.end_step = ran, ended
    return times, peaks


@pytest.mark.parametrize("precision,passes,clip", [("fp32", 1, None), ("bf16", 1, None), ("fp32", 2, 0.2)])
def test_tied_halves_on_ssd_are_bit_identical_to_host(tmp_path, hf_kit, precision, passes, clip):
    """The tied table's gradient exchange, accumulation and the clipping norm read the gradients where their
    tier keeps them: weights and states streamed from SSD give the bits of host memory."""
    from mobiuspipe.config import MemoryConfig

    hf_kit.save_model("gpt2", tmp_path / "src", seed=2)
    m = open_hf(tmp_path / "src", 9)
    batches = hf_kit.random_batches(2, 4 * passes, 9, seed=4)
    runs = []
    for memory in (None, MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path / "ssd"))):
        with Pipeline(
            layer_factories(m),
            lm_loss,
            sample=(batches[0][0][:4], batches[0][1][:4]),
            num_microbatches=2,
            num_stages=3,
            precision=precision,
            memory=memory,
            tied=m.tied_params(),
            accumulation_steps=passes,
            max_grad_norm=clip,
        ) as pipe:
            results = [pipe.train_batch(x, y) for x, y in batches]
            runs.append(([(r.loss, r.grad_norm) for r in results], pipe.state_dict()))
    (host_losses, host), (ssd_losses, ssd) = runs
    assert host_losses == ssd_losses
    assert all(torch.equal(host[k], ssd[k]) for k in host)
    a, b = m.tied_params()[0]
    assert torch.equal(ssd[a], ssd[b])


@pytest.mark.parametrize("chunk", [None, 37])
def test_tied_halves_with_states_on_the_gpu_train_as_transformers_without_host_copies(
    tmp_path, hf_kit, monkeypatch, chunk
):
    """memory.optimizer device (the states on the gpu): the tied table's gradients are summed on the gpu, a chunk at
    a time (37 elements: many chunks, the last short), with no copy to host memory in a step; two accumulation
    passes and a clip that counts the pair once equal transformers + AdamW."""
    from mobiuspipe.config import MemoryConfig
    from mobiuspipe.memory.device import Device
    from mobiuspipe.runtime import tied

    if chunk is not None:
        monkeypatch.setattr(tied, "CHUNK", chunk)
    model = hf_kit.save_model("gpt2", tmp_path / "src", seed=8)
    m = open_hf(tmp_path / "src", 9)
    batches = hf_kit.random_batches(3, 12, 9, seed=3)
    want, want_norms = hf_kit.train_plain(model, batches, microbatches=6, lr=1e-2, max_norm=0.3)
    copies = []
    with _clipped_pipeline(m, batches, MemoryConfig(optimizer="device")) as pipe:
        to_host = Device.to_host
        monkeypatch.setattr(Device, "to_host", lambda self, t: copies.append(t.shape) or to_host(self, t))
        results = [pipe.train_batch(x, y) for x, y in batches]
        monkeypatch.undo()
        weights = pipe.state_dict()
    assert copies == []
    assert [r.loss for r in results] == pytest.approx(want, rel=1e-5)
    assert [r.grad_norm for r in results] == pytest.approx(want_norms, rel=1e-5)
    a, b = m.tied_params()[0]
    assert torch.equal(weights[a], weights[b])


def test_eval_batch_is_the_models_eval_loss(tmp_path, hf_kit):
    """Forward only, dropout off, after the pending updates: transformers' loss in eval mode, and no weight
    or later training loss changes."""
    model = hf_kit.save_model("gpt2", tmp_path / "src", seed=6, resid_pdrop=0.3, embd_pdrop=0.2)
    m = open_hf(tmp_path / "src", 10)
    (x, y), (hx, hy) = hf_kit.random_batches(2, 6, 10, seed=9)
    with Pipeline(
        layer_factories(m), lm_loss, sample=(x, y), num_microbatches=3, num_stages=4, tied=m.tied_params()
    ) as pipe:
        before = pipe.eval_batch(hx, hy)
        pipe.train_batch(x, y)
        after = pipe.eval_batch(hx, hy)
        weights = pipe.state_dict()
    with torch.no_grad():
        assert before == pytest.approx(float(lm_loss(model.eval()(hx).logits, hy)), rel=1e-6)
        model.load_state_dict({hf_key(m, int(k.split(".")[0]), k.split(".", 1)[1]): v for k, v in weights.items()})
        assert after == pytest.approx(float(lm_loss(model(hx).logits, hy)), rel=1e-6)
    assert after != before


def test_an_export_replaces_only_its_owners_folder(tmp_path):
    to = tmp_path / "export"
    check_export_dir(to, "k", "run-a")  # new
    to.mkdir()
    check_export_dir(to, "k", "run-a")  # empty
    (to / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"k: .*export exists and is not an empty folder; the export will not"):
        check_export_dir(to, "k", "run-a")
    (to / MARKER).write_text(json.dumps({"owner": "run-a"}))
    check_export_dir(to, "k", "run-a")  # run-a's own export: replaced at the end
    with pytest.raises(ConfigError, match=r"not an empty folder \(it was not written by this run, run-b\)"):
        check_export_dir(to, "k", "run-b")
    with pytest.raises(ConfigError, match="not an empty folder;"):
        check_export_dir(to, "k")


def test_finish_export_replaces_its_owners_export_and_leaves_no_remains(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "m")
    m, to = open_hf(tmp_path / "m", 16), tmp_path / "export"
    to.mkdir()
    (to / "model-00001-of-00003.safetensors").write_text("an earlier export's shard")
    (to / MARKER).write_text(json.dumps({"owner": "a"}))
    partial_dir(to).mkdir()
    finish_export(m, {0: {}, 1: {}}, 2, to, torch.float32, "a")
    assert not (to / "model-00001-of-00003.safetensors").exists()
    assert json.loads((to / MARKER).read_text()) == {"owner": "a"} and (to / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "m"]


def test_the_export_keeps_the_tokenizer_and_its_chat_template(tmp_path, hf_kit, chat_tokenizer_dir):
    """A chat model's export carries its tokenizer whole: transformers 5 saves the chat template in
    chat_template.jinja, beside tokenizer.json and tokenizer_config.json."""
    from transformers import AutoTokenizer

    hf_kit.save_model("llama", tmp_path / "m")
    chat_tokenizer_dir(tmp_path / "m")
    want = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert want.chat_template  # the fixture's template, wherever this transformers keeps it
    m, to = open_hf(tmp_path / "m", 16), tmp_path / "export"
    partial_dir(to).mkdir()
    finish_export(m, {0: {}}, 1, to, torch.float32, "a")
    got = AutoTokenizer.from_pretrained(str(to))
    assert got.chat_template == want.chat_template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)


def test_a_failed_export_write_is_named_and_leaves_the_earlier_export(tmp_path, hf_kit, monkeypatch):
    """A shard that cannot be written (safetensors' own error for a full disk, as an OSError would be) is an
    ExportError naming the rank, the file and the fix, raised after every rank's result is in (no rank is left
    waiting), and the export folder keeps what it held."""
    from safetensors import SafetensorError

    from mobiuspipe.errors import ExportError
    from mobiuspipe.models import hf_export
    from mobiuspipe.run.train import _export

    hf_kit.save_model("gpt2", tmp_path / "m", seed=2)
    m = open_hf(tmp_path / "m", 9)
    x, y = hf_kit.random_batches(1, 4, 9, seed=4)[0]
    to = tmp_path / "export"
    to.mkdir()
    (to / MARKER).write_text(json.dumps({"owner": "a"}))

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_export, "save_file", full)
    with Pipeline(layer_factories(m), lm_loss, sample=(x, y), num_microbatches=2, num_stages=3) as pipe:
        with pytest.raises(ExportError, match=r"rank 0 could not write .*model-00001-of-00003.safetensors: .*os error"):
            _export(pipe, m, to, torch.float32, "a")
    assert sorted(p.name for p in to.iterdir()) == [MARKER]
