"""Pipeline(lora=...) on 2 ranks x 4 stages under torchrun (gloo) trains as peft + torch AdamW does on the same
batches: the adapters of every rank's stages, drawn from the same seed, and the base frozen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mobiuspipe.lora.layers import adapter_parameters, with_adapters
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.hf import hf_key, layer_factories, open_hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

SPEC = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
SCRIPT = """
import json, sys
from functools import partial
import torch
from mobiuspipe import Pipeline
from mobiuspipe.lora.spec import LoraSpec
from mobiuspipe.models.gpt import lm_loss
from mobiuspipe.models.hf import layer_factories, open_hf
from mobiuspipe.optim import CPUAdam

folder, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = open_hf(folder, 13)
batches = torch.load(sys.argv[3])
spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
opt = partial(CPUAdam, lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
with Pipeline(layer_factories(m), lm_loss, sample=batches[0], num_microbatches=4, num_stages=4, optimizer=opt,
              lora=spec) as pipe:
    losses = [pipe.train_batch(x, y).loss for x, y in batches]
    if pipe.rank == 0:
        json.dump({"losses": losses, "mapping": pipe.plan.mapping}, open(out, "w"))
"""


@pytest.mark.timeout(300)
def test_two_ranks_train_the_adapters_as_peft_does(tmp_path, hf_kit):
    from transformers import AutoModelForCausalLM

    hf_kit.save_model("llama", tmp_path / "base", seed=6)
    batches = hf_kit.random_batches(3, 8, 13, seed=9)
    torch.save(batches, tmp_path / "batches.pt")
    (tmp_path / "run.py").write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(tmp_path / "run.py"),
    ]
    cmd += [str(tmp_path / "base"), str(tmp_path / "out.json"), str(tmp_path / "batches.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["mapping"] == [0, 1, 0, 1]

    m = open_hf(tmp_path / "base", 13)
    torch.manual_seed(0)  # the adapters every rank drew: the same seed, layer by layer
    layers = [make() for make in with_adapters(layer_factories(m), SPEC)]
    start = {
        "base_model.model." + hf_key(m, l, name): p.detach()
        for l, layer in enumerate(layers)
        for name, p in adapter_parameters(layer).items()
    }
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="sdpa")
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(SPEC.targets)))
    assert not peft.set_peft_model_state_dict(ref, start).unexpected_keys
    want = hf_kit.train_plain(ref, batches, microbatches=4, lr=5e-3)
    assert got["losses"] == pytest.approx(want, rel=1e-5)
