"""Per-layer profile of a model: bytes and seconds of each layer, the numbers every planner reads.

Symbols (per layer l, for ONE microbatch of `microbatch_size` sequences of `seq_len` tokens):
  P_l  param_bytes       bytes of the layer's parameters in the dtype loaded into the GPU     [bytes]
  A_l  activation_bytes  activations the layer keeps for its backward pass                    [bytes]
  O_l  output_bytes      the layer's output tensor, what crosses a stage boundary              [bytes]
  F_l  fwd_s             forward time                                                          [s]
  B_l  bwd_s             backward time (input and weight gradients, no recomputation)          [s]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["LayerProfile", "Profile"]


@dataclass(frozen=True)
class LayerProfile:
    """Cost of one layer for one microbatch."""

    name: str
    param_count: int
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    fwd_flops: float
    bwd_flops: float
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class Profile:
    """The layers of one model on one device type, for one microbatch shape."""

    model: str
    device: str
    dtype: str
    microbatch_size: int
    seq_len: int
    layers: tuple[LayerProfile, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = [asdict(x) for x in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        layers = tuple(LayerProfile(**x) for x in d["layers"])
        return cls(**{**d, "layers": layers})
