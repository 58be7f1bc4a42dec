"""A Hugging Face GPT-2 (tied embeddings, their halves on different ranks) and a Llama fine-tuned by the torchrun
entry (2 ranks, 4 stages, fp32) equal transformers + torch.optim.AdamW on the same batches; the run's export
and `mobiuspipe export` load with from_pretrained and give the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from mobiuspipe.cli import main as cli_main
from mobiuspipe.config import load_config
from mobiuspipe.dataset import ByteData
from partition.plan import load_plan

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind,passes,clip", [("gpt2", 2, 0.3), ("llama", 1, None)])
def test_hf_model_trains_as_transformers_does(tmp_path, launch, hf_kit, kind, passes, clip):
    """GPT-2 also accumulates 2 passes and clips to a global norm that counts the tied pair (split over the
    ranks) once."""
    from transformers import AutoModelForCausalLM

    write_config, torchrun = launch
    model = hf_kit.save_model(kind, tmp_path / "src", seed=11)
    out, export = tmp_path / "out", tmp_path / "export"
    cfg_path = write_config(
        tmp_path,
        {
            "model": {"hf": str(tmp_path / "src"), "seq_len": 17},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "train": {
                "steps": 3,
                "lr": 0.004,
                "seed": 2,
                "precision": "fp32",
                "out_dir": str(out),
                "export_dir": str(export),
                "accumulation_steps": passes,
                "max_grad_norm": clip,
            },
            "plan": {"num_gpus": 2, "num_stages": 4, "mapping": "cross"},
        },
    )
    proc = torchrun(cfg_path, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = load_plan(out / "plan.yaml")
    if kind == "gpt2":  # the tied table's halves: the embedding's stage and the head's, on different ranks
        assert plan.mapping[0] != plan.mapping[-1]
    cfg = load_config(cfg_path)
    data = ByteData(cfg.data.text_path, 17, cfg.train.seed)
    batches = [data.batch(s, 8 * passes) for s in range(3)]
    want = hf_kit.train_plain(model, batches, microbatches=4 * passes, lr=0.004, max_norm=clip)
    want = want[0] if clip else want
    got = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert got == pytest.approx(want, rel=1e-5)

    assert cli_main(["export", "--run", str(out), "--to", str(tmp_path / "again")]) == 0
    x = torch.randint(0, hf_kit.VOCAB, (2, 17))
    with torch.no_grad():
        trained = model.eval()(x).logits
        for folder in (export, tmp_path / "again"):
            back = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
            torch.testing.assert_close(back(x).logits, trained, rtol=1e-4, atol=1e-4)
    assert (export / "model-00004-of-00004.safetensors").is_file()
