"""Small random Hugging Face models saved to local folders, and plain transformers training: the yardstick
the pipeline's Hugging Face path must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mobiuspipe.models.gpt import lm_loss

VOCAB = 301
"""Above 256 so that byte-level data fits, and odd."""


def hf_config(kind: str, **over):
    """A tiny config of `kind` (gpt2, llama, mistral, qwen2) with odd sizes and no dropout."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if kind == "gpt2":
        d: dict = dict(vocab_size=VOCAB, n_embd=24, n_layer=3, n_head=3, n_positions=48, n_inner=40)
        d.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2Config(**{**d, **over})
    d: dict = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4)
    d.update(num_key_value_heads=2, max_position_embeddings=48, bos_token_id=0, eos_token_id=0)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    if kind == "mistral":
        d["sliding_window"] = 48
    if kind == "qwen2":
        d["tie_word_embeddings"] = True  # as Qwen2-0.5B: a tied llama-family head
    return cls(**{**d, **over})


def save_model(kind: str, folder: Path, seed: int = 0, **over):
    """A random model of `kind` saved by save_pretrained into folder; returns the model (train mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **over), attn_implementation="sdpa")
    model.save_pretrained(str(folder))
    return model.train()


def train_plain(
    model,
    batches,
    microbatches: int,
    lr: float,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.0,
    max_norm=None,
    after=None,
    delayed: int | None = None,
):
    """Losses per step (and the gradient norms before clipping) of transformers' model trained with
    torch.optim.AdamW on (x, y) batches, gradients accumulated over the microbatches as the pipeline does
    (microbatches = every microbatch of the step, all accumulation passes), clipped by clip_grad_norm_;
    after(step, model) is called after each step's update. delayed (train.delayed_update): from that step on, a
    step's gradients are computed before the update of the step before is applied (then it is), the last one
    applied at the end (after() is then not called)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses, norms = [], []
    rule = DelayedRule(params, opt, delayed) if delayed is not None else None
    for s, (x, y) in enumerate(batches):
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = lm_loss(model(xi).logits, yi) / microbatches
            loss.backward()
            total += loss.item()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        losses.append(total)
        if rule is not None:
            rule.update(s)
            continue
        opt.step()
        if after is not None:
            after(len(losses) - 1, model)
    if rule is not None:
        rule.finish()
    return (losses, norms) if max_norm is not None else losses


class DelayedRule:
    """The delayed update's rule (train.delayed_update) over a plain optimizer: after step s's gradients (clipped),
    update(s) applies the update of step s - 1 if it was held back, then step s's own unless step s + 1 is delayed
    (s + 1 >= delayed), in which case it is held back; finish() applies the last one held back."""

    def __init__(self, params: list, opt: torch.optim.Optimizer, delayed: int):
        self.params, self.opt, self.delayed, self.pending = params, opt, delayed, None

    def update(self, s: int) -> None:
        grads = [p.grad.clone() for p in self.params]
        self.finish()
        if s + 1 >= self.delayed:
            self.pending = grads
        else:
            self._apply(grads)

    def finish(self) -> None:
        if self.pending is not None:
            self._apply(self.pending)
            self.pending = None

    def _apply(self, grads: list) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt.step()


def random_batches(steps: int, batch: int, seq_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        s = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
        out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return out


def token_file(path: Path, count: int, seed: int) -> np.ndarray:
    """`count` random ids below VOCAB written to `path` as a token file (uint16); returns them."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, count).astype(np.uint16)
    ids.tofile(path)
    return ids


def in_order(ids: np.ndarray, first: int, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences first .. first + rows - 1 of a token file read in order (data.shuffle false): sequence n is
    ids[n*T : n*T + T + 1], T = seq_len; (inputs, targets)."""
    t = seq_len
    seqs = torch.from_numpy(np.stack([ids[n * t : n * t + t + 1] for n in range(first, first + rows)]).astype(np.int64))
    return seqs[:, :-1], seqs[:, 1:]


def lora_pipeline(m, spec, batches, precision="fp32", activations=None, weight_decay=0.0, tied=(), memory=None, **kw):
    """A Pipeline of Hugging Face model m's layers with LoRA `spec`: 3 stages on this rank, 4 microbatches, planned
    from batches[0], CPUAdam at lr 5e-3 (the rate the LoRA tests give peft's AdamW); kw: Pipeline's other options."""
    from functools import partial

    from mobiuspipe import Pipeline
    from mobiuspipe.models.hf import layer_factories
    from mobiuspipe.optim import CPUAdam

    opt = partial(CPUAdam, lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    return Pipeline(
        layer_factories(m),
        lm_loss,
        sample=batches[0],
        num_microbatches=4,
        num_stages=3,
        optimizer=opt,
        precision=precision,
        activations=activations,
        tied=tied,
        memory=memory,
        lora=spec,
        **kw,
    )
