"""LoRA through the run config under torchrun (2 ranks x 4 stages, fp32, data in order): a tiny Llama with a new
adapter (lora:) on a token file and a GPT-2 continuing a PEFT adapter folder (model.adapter) on instruction data
(the loss on the responses alone) train as peft + torch.optim.AdamW does on the same batches, the base frozen;
the run's export (train.export_dir), `mobiuspipe export` and its --merge give the trained peft model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from mobiuspipe.cli import main as cli_main
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_run_data
from mobiuspipe.data.instruct import IGNORE
from mobiuspipe.lora.layers import adapter_parameters, with_adapters
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.hf import hf_key, layer_factories, open_hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

T = 17
"""seq_len of these runs."""
STEPS = 3
LR = 0.004


def _new_adapter_start(folder, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """The adapters a run with train.seed `seed` draws (every rank the same), keyed as PEFT's state dict."""
    m = open_hf(folder, T)
    torch.manual_seed(seed)
    layers = [make() for make in with_adapters(layer_factories(m), spec)]
    return {
        "base_model.model." + hf_key(m, l, name): p.detach().clone()
        for l, layer in enumerate(layers)
        for name, p in adapter_parameters(layer).items()
    }


def _peft_model(folder, kind: str, spec: LoraSpec, start, tmp_path):
    """peft's model of the base in `folder` with the run's starting adapter: new (start: its tensors) or the
    PEFT folder the run continues (start: None; written here, with random B so that it is not the base)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    config = peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), fan_in_fan_out=kind == "gpt2"
    )
    model = peft.get_peft_model(base, config)
    if start is not None:
        assert not peft.set_peft_model_state_dict(model, start).unexpected_keys
        return model
    torch.manual_seed(21)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(tmp_path / "saved"))
    base = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    return peft.PeftModel.from_pretrained(base, str(tmp_path / "saved"), is_trainable=True)


def _token_data(tmp_path, hf_kit) -> dict:
    hf_kit.token_file(tmp_path / "train.bin", STEPS * 8 * T + 1 + 4, seed=8)
    return {"tokens": str(tmp_path / "train.bin")}


def _instruction_data(tmp_path, chat_tokenizer_dir) -> dict:
    """24 short examples, prompt/response and chat, from the chat tokenizer (its template)."""
    words = "a quick brown fox jumps over the lazy dog pipelines stream weights from the host".split()
    lines = []
    for k in range(STEPS * 8):
        ask, say = " ".join(words[k % 5 : k % 5 + 3]), " ".join(words[k % 7 : k % 7 + 1 + k % 4])
        if k % 2:
            lines.append({"prompt": ask, "response": " " + say})
        else:
            chat = [{"role": "user", "content": ask}, {"role": "assistant", "content": say}]
            lines.append({"messages": chat})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    tok = chat_tokenizer_dir(tmp_path / "tok")
    return {"path": str(tmp_path / "train.jsonl"), "format": "instruction", "tokenizer": str(tok)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kind,targets,continued,clip,frozen,optimizer,delayed",
    [
        ("llama", ("q_proj", "v_proj", "down_proj", "lm_head"), False, 0.5, "host", "device", None),
        ("gpt2", ("c_attn", "c_fc"), True, None, "ssd", "host", None),
        ("gpt2", ("c_attn",), False, 0.05, "host", "host", 1),
    ],
)
def test_a_lora_run_trains_as_peft_does_and_exports_its_adapter(
    tmp_path, launch, hf_kit, chat_tokenizer_dir, kind, targets, continued, clip, frozen, optimizer, delayed
):
    """frozen: where the base is (memory.frozen; on the SSD, streamed at each load, the same numbers); optimizer:
    where the adapters' states are (memory.optimizer; on the gpu, clipped by the norm taken there); delayed: the
    delayed update from that step on (train.delayed_update), against peft under the same rule."""
    from transformers import AutoModelForCausalLM

    write_config, torchrun = launch
    data = _token_data(tmp_path, hf_kit) if not continued else _instruction_data(tmp_path, chat_tokenizer_dir)
    hf_kit.save_model(kind, tmp_path / "src", seed=13)
    spec = LoraSpec(rank=3, alpha=7.0, targets=targets)
    start = None if continued else _new_adapter_start(tmp_path / "src", spec, seed=5)
    ref = _peft_model(tmp_path / "src", kind, spec, start, tmp_path)
    lora = {} if continued else {"rank": spec.rank, "alpha": spec.alpha, "targets": list(targets)}
    model = {"hf": str(tmp_path / "src"), "seq_len": T} | ({"adapter": str(tmp_path / "saved")} if continued else {})
    out, export = tmp_path / "out", tmp_path / "export"
    cfg = {
        "model": model,
        "data": data | {"shuffle": False, "batch_size": 8, "num_microbatches": 4},
        "train": {
            "steps": STEPS,
            "lr": LR,
            "seed": 5,
            "precision": "fp32",
            "max_grad_norm": clip,
            "delayed_update": delayed,
            "out_dir": str(out),
            "export_dir": str(export),
        },
        "plan": {"num_gpus": 2, "num_stages": 4},
        "memory": {"frozen": frozen, "optimizer": optimizer}
        | ({"ssd_dir": str(tmp_path / "ssd")} if frozen == "ssd" else {}),
    }
    proc = torchrun(write_config(tmp_path, cfg | ({"lora": lora} if lora else {})), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LoRA adapters (continuing" in proc.stdout if continued else "LoRA adapters (new)" in proc.stdout
    assert ("the base frozen (" + ("on the SSD, " if frozen == "ssd" else "")) in proc.stdout

    train = open_run_data(config_from_dict(cfg))[0]  # the run's batches, as a rank reads them
    batches = [train.batch(s, 8) for s in range(STEPS)]
    assert continued == bool((batches[0][1] == IGNORE).any())  # instruction data: prompts and padding masked
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    want = hf_kit.train_plain(ref, batches, microbatches=4, lr=LR, max_norm=clip, delayed=delayed)
    want = want[0] if clip else want
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["kind"] == "train"] == pytest.approx(want, rel=1e-5)
    assert all(torch.equal(p, frozen[n]) for n, p in ref.named_parameters() if n in frozen)

    # nothing is written for the frozen base: the run's weights are its adapters (fp32), and a little pickling
    adapter_bytes = 4 * sum(p.numel() for n, p in ref.named_parameters() if p.requires_grad)
    files = list((out / "weights").iterdir())
    held = sum(t.nbytes for f in files for t in torch.load(f, weights_only=True).values())
    written = sum(f.stat().st_size for f in files)
    assert (
        held == adapter_bytes < written < adapter_bytes + 4096 * len(files) < 4 * sum(map(torch.numel, frozen.values()))
    )

    assert cli_main(["export", "--run", str(out), "--to", str(tmp_path / "again")]) == 0
    assert cli_main(["export", "--run", str(out), "--to", str(tmp_path / "merged"), "--merge"]) == 0
    x = torch.randint(0, hf_kit.VOCAB, (2, T))
    with torch.no_grad():
        want = ref.eval()(x).logits
        for folder in (export, tmp_path / "again"):
            base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "src"), attn_implementation="sdpa")
            back = peft.PeftModel.from_pretrained(base, str(folder)).eval()
            torch.testing.assert_close(back(x).logits, want, rtol=1e-4, atol=1e-4)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="sdpa").eval()
        torch.testing.assert_close(merged(x).logits, want, rtol=1e-4, atol=1e-4)
    assert json.loads((export / "adapter_config.json").read_text())["r"] == spec.rank
