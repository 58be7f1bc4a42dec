"""Byte-level training data: a text file read as bytes, sampled into (input, target) sequences."""

from __future__ import annotations

from pathlib import Path

import torch

from mobiuspipe.errors import ConfigError

__all__ = ["ByteData"]


class ByteData:
    """Every rank builds the same batches from (seed, step), so no rank ships data to another."""

    def __init__(self, path: str, seq_len: int, seed: int):
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise ConfigError(
                f"data.path: cannot read {self.path}: {e.strerror}; give a readable text file "
                f"or leave data.path out to use the shipped sample"
            ) from e
        if len(raw) < seq_len + 2:
            raise ConfigError(
                f"data.path: {self.path} has {len(raw)} bytes, expected at least seq_len + 2 = "
                f"{seq_len + 2}; use a longer file or a smaller model.seq_len"
            )
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, seq_len); y is x shifted by one byte."""
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        seq = self.tokens[idx]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
