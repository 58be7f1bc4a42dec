"""Save a tiny random Llama (or GPT-2) with transformers into a local folder, for examples/hf-llama.yaml and
examples/lora-llama.yaml.

    .venv/bin/python examples/make_tiny_hf.py runs/tiny-llama            # Llama: RoPE, GQA, RMSNorm, SwiGLU
    .venv/bin/python examples/make_tiny_hf.py runs/tiny-gpt2 --kind gpt2 # GPT-2: tied embeddings
    .venv/bin/python examples/make_tiny_hf.py runs/tiny-chat --chat      # Llama + a tokenizer with a chat template

The folder is what `save_pretrained` writes for a real checkpoint (config.json, model.safetensors); a
downloaded model folder (e.g. from `huggingface-cli download`) is used the same way. Nothing is downloaded
here. The vocabulary is 256 tokens, so the byte-level sample text trains it without a tokenizer; with --chat it
is 512, and the folder also holds a byte-level BPE tokenizer trained on the packaged sample text, whose chat
template renders each message as <|role|>content<|end|> (tokenizer.json, tokenizer_config.json).
"""

from __future__ import annotations

import argparse
from importlib import resources

import torch

import mobiuspipe  # noqa: F401  (first: it quiets torchao's warnings about CUDA kernels a CPU build cannot load)

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def save_chat_tokenizer(folder: str, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` ids trained on mobiuspipe/data/sample.txt, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = (resources.files("mobiuspipe") / "data" / "sample.txt").read_text()
    tok.train_from_iterator(text.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("folder", help="where to save the model (created)")
    p.add_argument("--kind", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--chat", action="store_true", help="a 512-token vocabulary and a chat tokenizer beside it")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    vocab = 512 if args.chat else 256
    if args.kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    else:
        config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=4, n_head=4, n_positions=256, bos_token_id=1,
                            eos_token_id=2)  # fmt: skip
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.folder)
    if args.chat:
        save_chat_tokenizer(args.folder, vocab)
    print(f"saved a {sum(p.numel() for p in model.parameters()):,}-parameter {args.kind} to {args.folder}")


if __name__ == "__main__":
    main()
