"""Save a tiny random Llama (or GPT-2) with transformers into a local folder, for examples/hf-llama.yaml.

    .venv/bin/python examples/make_tiny_hf.py runs/tiny-llama            # Llama: RoPE, GQA, RMSNorm, SwiGLU
    .venv/bin/python examples/make_tiny_hf.py runs/tiny-gpt2 --kind gpt2 # GPT-2: tied embeddings

The folder is what `save_pretrained` writes for a real checkpoint (config.json, model.safetensors); a
downloaded model folder (e.g. from `huggingface-cli download`) is used the same way. Nothing is downloaded
here. The vocabulary is 256 tokens, so the byte-level sample text trains it without a tokenizer.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("folder", help="where to save the model (created)")
    p.add_argument("--kind", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if args.kind == "llama":
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    else:
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=256, bos_token_id=1,
                            eos_token_id=2)  # fmt: skip
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.folder)
    print(f"saved a {sum(p.numel() for p in model.parameters()):,}-parameter {args.kind} to {args.folder}")


if __name__ == "__main__":
    main()
