"""Host memory a text file takes to tokenize as one document: the figure behind mobiuspipe.data.tokenizer's
ENCODING_BYTES_PER_TOKEN, against the ids' own 4 bytes a token (the yardstick), in one run.

Usage: .venv/bin/python scripts/bench_tokenize_memory.py [--size-mb 8] [--vocab 512]

A byte-level BPE of --vocab ids is trained on mobiuspipe/data/sample.txt (examples/make_tiny_hf.py); a text file of
--size-mb MB of that text repeated is tokenized whole (tokenize_file, as data.path and `mobiuspipe tokenize` do) in a
fresh process, which reports its peak resident set before and after (ru_maxrss).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys
from mobiuspipe.data.tokenizer import load_tokenizer, tokenize_file
tok = load_tokenizer(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = tokenize_file(tok, sys.argv[2], "text", "bench")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": len(ids), "grew_bytes": (after - before) * 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description="a text file's memory tokenized as one document")
    p.add_argument("--size-mb", type=float, default=8.0)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("make_tiny_hf", ROOT / "examples" / "make_tiny_hf.py")
    assert spec is not None and spec.loader is not None
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    save_chat_tokenizer = helpers.save_chat_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        save_chat_tokenizer(f"{tmp}/tok", args.vocab)
        text = (ROOT / "mobiuspipe" / "data" / "sample.txt").read_text()
        size = int(args.size_mb * 1e6)
        Path(f"{tmp}/big.txt").write_text((text * (size // len(text) + 1))[:size])
        out = subprocess.run(
            [sys.executable, "-c", CHILD, f"{tmp}/tok", f"{tmp}/big.txt"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    per = got["grew_bytes"] / got["tokens"]
    print(
        f"{got['tokens']:,} tokens from {args.size_mb:g} MB of text: the peak resident set grew "
        f"{got['grew_bytes'] / 2**20:,.0f} MiB, {per:.0f} bytes a token = {per / 4:.0f}x the ids' own 4 bytes; "
        f"{size / got['tokens']:.2f} bytes of text a token"
    )


if __name__ == "__main__":
    main()
