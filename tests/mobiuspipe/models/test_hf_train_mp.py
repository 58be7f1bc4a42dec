"""A Hugging Face GPT-2 (tied embeddings, their halves on different ranks) and a Llama fine-tuned by the torchrun
entry (2 ranks, 4 stages, fp32, a token file in order) equal transformers + torch.optim.AdamW on the same
batches, its evaluations on the held-out file equal transformers' eval loss, and the run's export and
`mobiuspipe export` load with from_pretrained and give the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from mobiuspipe.cli import main as cli_main
from mobiuspipe.models.gpt import lm_loss
from partition.plan import load_plan

pytestmark = pytest.mark.slow

T = 17
"""seq_len of these runs."""


def _eval_loss(model, batches) -> float:
    """transformers' model in eval mode: the mean over the held-out batches of each batch's mean loss."""
    model.eval()
    with torch.no_grad():
        losses = [float(lm_loss(model(x).logits, y)) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


@pytest.mark.parametrize(
    "kind,passes,clip,delayed,states",
    [
        ("gpt2", 2, 0.3, None, "host"),
        ("llama", 1, None, None, "host"),
        ("gpt2", 2, 0.3, 2, "ssd"),
        ("gpt2", 2, 0.3, None, "device"),
    ],
)
def test_hf_model_trains_as_transformers_does(tmp_path, launch, hf_kit, kind, passes, clip, delayed, states):
    """GPT-2 also accumulates 2 passes and clips to a global norm that counts the tied pair (split over the
    ranks) once; with the delayed update from step 2 (train.delayed_update) and its states on the SSD, it trains
    as transformers under the same rule (no evaluation: each flushes the pending update); so it does with its
    states on the gpu (memory.optimizer device: the tied halves exchanged from gpu memory)."""
    from transformers import AutoModelForCausalLM

    write_config, torchrun = launch
    model = hf_kit.save_model(kind, tmp_path / "src", seed=11)
    rows, steps = 8 * passes, 3 if delayed is None else 4  # sequences per optimizer step; steps
    train_ids = hf_kit.token_file(tmp_path / "train.bin", steps * rows * T + 1 + 5, seed=4)
    eval_ids = hf_kit.token_file(tmp_path / "eval.bin", 2 * 8 * T + 1 + 3, seed=5)
    out, export = tmp_path / "out", tmp_path / "export"
    cfg_path = write_config(
        tmp_path,
        {
            "model": {"hf": str(tmp_path / "src"), "seq_len": T},
            "data": {
                "tokens": str(tmp_path / "train.bin"),
                "eval_path": str(tmp_path / "eval.bin"),
                "shuffle": False,
                "batch_size": 8,
                "num_microbatches": 4,
            },
            "train": {
                "steps": steps,
                "lr": 0.004,
                "seed": 2,
                "precision": "fp32",
                "out_dir": str(out),
                "export_dir": str(export),
                "accumulation_steps": passes,
                "max_grad_norm": clip,
                "delayed_update": delayed,
            }
            | ({"eval_every": 2, "eval_at_start": True} if delayed is None else {}),
            "plan": {"num_gpus": 2, "num_stages": 4, "mapping": "cross"},
        }
        | ({"memory": {"optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")}} if states == "ssd" else {})
        | ({"memory": {"optimizer": "device"}} if states == "device" else {}),
    )
    proc = torchrun(cfg_path, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = load_plan(out / "plan.yaml")
    if kind == "gpt2":  # the tied table's halves: the embedding's stage and the head's, on different ranks
        assert plan.mapping[0] != plan.mapping[-1]
    held_out = [hf_kit.in_order(eval_ids, 8 * k, 8, T) for k in range(2)]
    evals = {-1: _eval_loss(model, held_out)}  # the pretrained weights, through both ranks' stages

    def evaluate(step, trained):
        if step in (1, 2):  # eval_every 2 over 3 steps: after step 2 and after the last
            evals[step] = _eval_loss(trained, held_out)

    batches = [hf_kit.in_order(train_ids, s * rows, rows, T) for s in range(steps)]
    want = hf_kit.train_plain(
        model, batches, microbatches=4 * passes, lr=0.004, max_norm=clip, after=evaluate, delayed=delayed
    )
    want, want_norms = want if clip else (want, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in records if r["kind"] == "train"]
    assert got == pytest.approx(want, rel=1e-5)
    norms = [r["grad_norm"] for r in records if r["kind"] == "train"]
    assert norms == (pytest.approx(want_norms, rel=1e-5) if clip else [None] * steps)
    if delayed is None:
        got_evals = {r["step"]: r["loss"] for r in records if r["kind"] == "eval"}
        assert got_evals == pytest.approx(evals, rel=1e-5) and set(got_evals) == {-1, 1, 2}
        assert "eval before training: loss" in proc.stdout and "eval after step 1: loss" in proc.stdout

    assert cli_main(["export", "--run", str(out), "--to", str(tmp_path / "again")]) == 0
    x = torch.randint(0, hf_kit.VOCAB, (2, 17))
    with torch.no_grad():
        trained = model.eval()(x).logits
        for folder in (export, tmp_path / "again"):
            back = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
            torch.testing.assert_close(back(x).logits, trained, rtol=1e-4, atol=1e-4)
    assert (export / "model-00004-of-00004.safetensors").is_file()


@pytest.mark.timeout(300)
def test_a_finished_hf_run_is_extended_and_its_export_replaced(tmp_path, launch, hf_kit):
    """The same config, more steps, --resume auto: the run continues from its last checkpoint and replaces the
    export it wrote (an export of another run, or a folder of other files, is still refused)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from mobiuspipe.models.hf_export import MARKER

    write_config, _ = launch
    hf_kit.save_model("llama", tmp_path / "src", seed=3)
    hf_kit.token_file(tmp_path / "train.bin", 4 * 8 * T + 1, seed=6)
    out, export = tmp_path / "out", tmp_path / "export"
    doc = {
        "model": {"hf": str(tmp_path / "src"), "seq_len": T},
        "data": {"tokens": str(tmp_path / "train.bin"), "batch_size": 8, "num_microbatches": 4},
        "train": {
            "steps": 2,
            "precision": "fp32",
            "out_dir": str(out),
            "export_dir": str(export),
            "checkpoint_every": 2,
        },
        "plan": {"num_gpus": 2, "num_stages": 4},
    }

    def train(steps: int) -> subprocess.CompletedProcess:
        config = write_config(tmp_path, {**doc, "train": {**doc["train"], "steps": steps}})
        cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(config), "--resume", "auto"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240)

    first = train(2)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {f.name: load_file(f) for f in export.glob("*.safetensors")}
    second = train(3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "exported the fine-tuned model" in second.stdout
    after = {f.name: load_file(f) for f in export.glob("*.safetensors")}
    assert before.keys() == after.keys() and any(
        not torch.equal(before[f][k], after[f][k]) for f in after for k in after[f]
    )  # the third step's weights
    assert json.loads((export / MARKER).read_text())["owner"] == str(out.resolve())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")] == []
    (export / MARKER).write_text(json.dumps({"owner": "/another/run"}))
    refused = train(4)
    assert refused.returncode == 2 and "it was not written by this run" in refused.stderr, refused.stderr[-3000:]
