"""The run config's `data:` section: the training and held-out data, their tokenizer, and the batches."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from importlib import resources

from foundation.loader import Problem, at_least, non_empty, rule
from mobiuspipe.config.section import AUTO_COUNT, Section, divisible

__all__ = ["DataConfig", "FORMATS", "TOKEN_DTYPES", "is_jsonl", "is_token_file"]

FORMATS = ("text", "instruction")
"""What the data is: documents packed into one stream, or instruction examples, one per sequence."""
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
"""The integer types of a token file, and the bytes of one token id in each."""


def is_jsonl(path: str) -> bool:
    """A JSONL file (one JSON object per line): the name ends in .jsonl."""
    return path.lower().endswith(".jsonl")


def needs_tokenizer(path: str) -> bool:
    """A source whose documents are tokenized: JSONL, or a datasets folder."""
    return is_jsonl(path) or os.path.isdir(path)


def is_token_file(path: str) -> bool:
    """A token file (raw token ids, the nanoGPT layout): the name ends in .bin."""
    return path.lower().endswith(".bin")


@dataclass(frozen=True, kw_only=True)
class DataConfig(Section):
    """The training data (text, JSONL or a token file), its tokenizer, and how it is cut into batches.

    Every source becomes one stream of token ids, packed into sequences of seq_len + 1 tokens: sequence n
    is tokens[n*T : n*T + T + 1] (T = model.seq_len; inputs its first T, targets its last T), so there are
    (tokens - 1) // T of them; step s takes the batch_size sequences s*B .. s*B + B - 1 of the order (in
    file order, or shuffled per epoch), wrapping into the next epoch.
    """

    path: str | None = dataclasses.field(
        default=None,
        metadata={
            "path_fix": "correct the path, or remove data.path to train on the packaged sample text",
            "or_folder": True,
        },
    )
    """The training text: a JSONL file (a name ending .jsonl: one JSON object per line, the document under
    `field`; needs `tokenizer`), a local Hugging Face datasets folder (save_to_disk's, or .parquet, .arrow or
    .jsonl files; its `split`; each row's `field`, or an instruction example; needs `tokenizer`), or any other
    file as text; None = mobiuspipe/data/sample.txt shipped in the package (unless `tokens` is given). A relative
    path is resolved against the config file's folder."""
    tokens: str | None = dataclasses.field(
        default=None,
        metadata={"path_fix": "correct the path, or write the file with `mobiuspipe tokenize -o FILE.bin`"},
    )
    """A token file instead of `path` (the two are exclusive): token ids as raw `token_dtype` integers,
    little-endian, no header (nanoGPT's train.bin), e.g. from `mobiuspipe tokenize`; read through a memory
    map, never whole. A relative path is resolved against the config file's folder."""
    token_dtype: str = "uint16"
    """The integer type of each token id in `tokens` and in a .bin `eval_path`: "uint16" (2 bytes, ids below
    65536) or "uint32" (4 bytes)."""
    tokenizer: str | None = dataclasses.field(
        default=None,
        metadata={
            "folder_fix": "give the folder that holds tokenizer.json (the model's own folder, as "
            "save_pretrained writes it), or remove data.tokenizer for byte-level tokens"
        },
    )
    """A tokenizer folder as Hugging Face `save_pretrained` writes it: tokenizer.json, and optionally
    tokenizer_config.json whose eos_token ends each document. `path` (and a text `eval_path`) are tokenized
    with it at start-up; its vocabulary, added tokens included, must fit model.vocab_size. None = the text
    is read as bytes (token ids 0..255). A relative path is resolved against the config file's folder."""
    field: str = "text"
    """The key of each JSONL line whose string value is the document (for a .jsonl path or eval_path)."""
    split: str = "train"
    """The split of a datasets folder `path` that holds several (a DatasetDict's)."""
    eval_split: str = "validation"
    """The split of a datasets folder `eval_path` that holds several."""
    format: str = "text"
    """"text": documents (text, JSONL `field`s or a token file) in one stream of tokens, packed. "instruction":
    JSONL examples, each a `messages` list (rendered with the tokenizer folder's chat template) or a `prompt`
    and `response`, one example per sequence (cut to seq_len + 1 tokens, padded), the loss on the assistant's
    or response's tokens alone (mobiuspipe/data/instruct.py has the rules); path and eval_path are .jsonl, a
    tokenizer is needed."""
    shuffle: bool = True
    """Shuffle the packed sequences: each epoch a new permutation of them, seeded by (train.seed, epoch),
    the same on every rank. False: step s takes sequences s*B .. s*B + B - 1 in file order. True by
    default, as a fine-tuning run expects (files are often sorted by source or date, and a batch of
    neighbours is a poor gradient estimate); the run stays reproducible from the seed either way."""
    eval_path: str | None = dataclasses.field(
        default=None,
        metadata={
            "path_fix": "correct the path, or remove data.eval_path to train without a held-out set",
            "or_folder": True,
        },
    )
    """Held-out data: a name ending .bin is a token file of `token_dtype`; any other is text, JSONL or a datasets
    folder (its `eval_split`) read and tokenized as `path` is. Packed the same way (instruction examples: one per
    sequence), read in file order, never shuffled; it must hold at least one batch. None = no held-out set. A
    relative path is resolved against the config file's folder."""
    batch_size: int = 8
    """Sequences per optimizer step (sequences; per pass with train.accumulation_steps); a multiple of
    num_microbatches."""
    num_microbatches: int | None = dataclasses.field(default=None, metadata=AUTO_COUNT)
    """Microbatches each batch is split into for the pipeline (count); auto (or null, or left out): the planner
    weighs every count that divides batch_size, each with its microbatch size, and keeps the fastest predicted step
    that fits the memory (`mobiuspipe partition --config` shows the choice)."""

    @property
    def microbatch_size(self) -> int | None:
        """Sequences per microbatch; None when the planner chooses them (num_microbatches auto)."""
        return None if self.num_microbatches is None else self.batch_size // self.num_microbatches

    @property
    def text_path(self) -> str:
        """The text or JSONL file to train on: `path`, or the sample text shipped in the package."""
        if self.path is not None:
            return self.path
        return str(resources.files("mobiuspipe") / "data" / "sample.txt")

    def check_values(self) -> list[Problem]:
        return [
            *at_least(self, "batch_size", 1, "use at least 1 sequence per step, e.g. 8"),
            *(
                at_least(self, "num_microbatches", 1, "use at least 1 microbatch, e.g. 4, or auto")
                + divisible("batch_size", self.batch_size, "num_microbatches", self.num_microbatches)
                if self.num_microbatches is not None
                else []
            ),
            *rule(
                self.token_dtype in TOKEN_DTYPES,
                "token_dtype",
                "one of " + ", ".join(TOKEN_DTYPES),
                repr(self.token_dtype),
                "use `token_dtype: uint16` (vocabularies up to 65536) or `uint32`",
            ),
            *non_empty(self, "field", "name the JSONL key that holds each document's text, e.g. `field: text`"),
            *rule(
                self.format in FORMATS,
                "format",
                "one of " + ", ".join(FORMATS),
                repr(self.format),
                "use `format: text` (documents) or `format: instruction` (prompt/response or messages)",
            ),
            *self._instruction_problems(),
            *self._source_problems(),
        ]

    def _instruction_problems(self) -> list[Problem]:
        """Instruction examples come from JSONL files, read with a tokenizer (its chat template)."""
        if self.format != "instruction":
            return []
        files = {"path": self.path, "eval_path": self.eval_path}
        jsonl = [v for v in files.values() if v is not None and needs_tokenizer(v)]
        return [
            *rule(
                self.tokens is not None or (self.path is not None and needs_tokenizer(self.path)),
                "path",
                'a .jsonl file or datasets folder of instruction examples ({"messages": [...]} or {"prompt": ..., '
                '"response": ...}), or their examples file from `mobiuspipe tokenize --format instruction` as '
                "data.tokens",
                repr(self.path),
                "give data.path a .jsonl file, or `format: text` for documents",
            ),
            *rule(
                self.eval_path is None or needs_tokenizer(self.eval_path) or is_token_file(self.eval_path),
                "eval_path",
                "held-out instruction examples: a .jsonl file, a datasets folder, or an examples file (.bin)",
                repr(self.eval_path),
                "give data.eval_path a .jsonl file, or `format: text` for documents",
            ),
            *rule(
                self.tokenizer is not None or not jsonl,
                "tokenizer",
                "a tokenizer folder (its chat template renders messages) for .jsonl examples",
                "no tokenizer",
                "set `tokenizer:` to the model's folder holding tokenizer.json and its chat template",
            ),
        ]

    def _source_problems(self) -> list[Problem]:
        """`path` and `tokens` exclusive, each file in a form its key takes, a tokenizer where JSONL needs one."""
        path, tokens, eval_path = self.path or "", self.tokens, self.eval_path or ""
        return [
            *rule(
                not (self.path and tokens),
                "tokens",
                "either data.path (text or JSONL) or data.tokens (a token file), not both",
                f"path {self.path!r} and tokens {tokens!r}",
                "keep one of them (`mobiuspipe tokenize` turns text into a token file)",
            ),
            *rule(
                not is_token_file(path),
                "path",
                "a text or JSONL file",
                f"{path!r}, a token file (.bin)",
                "give a token file as `tokens:` (with token_dtype), not `path:`",
            ),
            *rule(
                self.tokenizer is not None or not (needs_tokenizer(path) or needs_tokenizer(eval_path)),
                "tokenizer",
                "a tokenizer folder when path or eval_path is JSONL or a datasets folder (its documents are tokenized)",
                "no tokenizer",
                "set `tokenizer:` to the model's folder holding tokenizer.json, or give plain text",
            ),
            *rule(
                self.tokenizer is not None or not tokens or not eval_path or is_token_file(eval_path),
                "eval_path",
                "a token file (.bin) like data.tokens, or a tokenizer to read text with",
                f"{eval_path!r}, text with no tokenizer",
                "give a .bin held-out file (`mobiuspipe tokenize`), or set `tokenizer:`",
            ),
        ]
