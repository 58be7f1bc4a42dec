"""Per-layer profile of a model: bytes and seconds of each layer, the numbers every planner reads.

Symbols (per layer l, for ONE microbatch of `microbatch_size` sequences of `seq_len` tokens):
  P_l  param_bytes       bytes of the layer's parameters in the dtype loaded into the GPU     [bytes]
  A_l  activation_bytes  activations the layer keeps for its backward pass                    [bytes]
  O_l  output_bytes      the layer's output tensor, what crosses a stage boundary              [bytes]
  F_l  fwd_s             forward time (measured: the runtime's forward visit, without grad)    [s]
  B_l  bwd_s             backward time (input and weight gradients, no recomputation)          [s]
  R_l  recompute_s       the forward as the backward visit redoes it before its backward: with
                         grad, through the runtime's saved-tensor hooks (None: F_l, as the
                         analytic profile has it); the last stage runs it fused with its loss  [s]
  K_l  kept_s            the forward as a keep (or selective) stage's F runs it for a kept layer:
                         with grad, through the runtime's keep hooks, its graph kept until the
                         backward, M microbatches in a row, each in fresh memory (None: R_l)  [s]
  T_l  trainable_count   the parameters that train (a LoRA layer's adapters; the rest, frozen, get no
                         gradient and no optimizer state); None: all param_count              [-]
  X_l  workspace_bytes   the most bytes the layer's recompute and backward allocate beyond A_l and
                         O_l while they run: gradients of its intermediates, each weight's
                         gradient before it is added into the gradient slot (measured on CUDA by
                         the allocator's peak; counted by the analytic profile for a gpu; 0 on
                         the CPU stand-in, whose ledger counts none)                          [bytes]
  V_l  buffer_bytes      the layer's buffers (a causal mask, a rotary table) as the run keeps them,
                         floating ones in the training dtype: its stage's gpu holds them the
                         whole run, outside the arena (0 in the analytic profile: the built-in
                         and Hugging Face layers keep none there)                             [bytes]

Layer-similarity compression (Mobius, "Profiling"): a transformer's blocks are identical, so a profile
is stored and solved as runs of consecutive identical layers, (layer, count); `expand` undoes it.
Files (save_profile/load_profile) are YAML, or JSON by suffix, holding Profile.to_dict(); a file may
also carry "runs" (a list of {"count", "layer"}), which is checked against "layers", or stands in for
"layers" when that key is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.loader import (
    INVALID,
    Builder,
    Checked,
    Problem,
    at_least,
    non_empty,
    part_of,
    positive,
    read_file,
    save_file,
    to_plain,
)
from partition.errors import InvalidProfile, ProfileFileError

__all__ = [
    "LayerProfile",
    "Profile",
    "ProfileFileError",
    "compress",
    "expand",
    "load_profile",
    "runs_to_list",
    "profile_from_file_dict",
    "save_profile",
]

_WRITE_FIX = "write profiles with `mobiuspipe profile --model NAME -o FILE`"


class _ProfilePart(Checked):
    """A part of a profile: its problems raise InvalidProfile, a ProfileFileError."""

    invalid = InvalidProfile


@dataclass(frozen=True)
class LayerProfile(_ProfilePart):
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
    recompute_s: float | None = None
    """R_l of the legend; None: the same as fwd_s."""
    kept_s: float | None = None
    """K_l of the legend; None: the same as redo_s."""
    workspace_bytes: int = 0
    """X_l of the legend; 0 in profiles that did not measure it."""
    trainable_count: int | None = None
    """T_l of the legend; None: every parameter trains."""
    buffer_bytes: int = 0
    """V_l of the legend; 0 in profiles written before profiles measured it."""

    @property
    def trains(self) -> int:
        """T_l: trainable_count, or param_count when every parameter trains."""
        return self.param_count if self.trainable_count is None else self.trainable_count

    @property
    def redo_s(self) -> float:
        """R_l: recompute_s, or fwd_s when the profile has no separate figure."""
        return self.fwd_s if self.recompute_s is None else self.recompute_s

    @property
    def keep_s(self) -> float:
        """K_l: kept_s, or R_l when the profile has no separate figure."""
        return self.redo_s if self.kept_s is None else self.kept_s

    def check_values(self) -> list[Problem]:
        counts = ("param_count", "param_bytes", "activation_bytes", "output_bytes", "workspace_bytes", "buffer_bytes")
        amounts = ("fwd_flops", "bwd_flops", "fwd_s", "bwd_s")
        redo = tuple(n for n in ("recompute_s", "kept_s") if getattr(self, n) is not None)
        return [
            *non_empty(self, "name", _WRITE_FIX),
            *(p for name in counts for p in at_least(self, name, 0, _WRITE_FIX)),
            *(p for name in (*amounts, *redo) for p in positive(self, name, _WRITE_FIX, zero_ok=True)),
            *part_of(self, "trainable_count", "param_count", _WRITE_FIX),
        ]


@dataclass(frozen=True)
class Profile(_ProfilePart):
    """The layers of one model on one device type, for one microbatch shape."""

    model: str
    device: str
    dtype: str
    microbatch_size: int
    seq_len: int
    layers: tuple[LayerProfile, ...]
    input_bytes: int = 0
    """Bytes of one microbatch of the model's input (the first stage's input: token ids for a language
    model); 0 in profiles written before profiles recorded it."""
    target_bytes: int = 0
    """Bytes of one microbatch of the loss's targets; 0 in profiles written before profiles recorded it."""
    library_bytes: int = 0
    """W: the device memory the math libraries keep for a stream once it has run the layers (cuBLAS and cuBLASLt
    workspaces, one set per stream; the runtime computes on its own stream), measured on CUDA; the device's
    DeviceSpec.library_bytes in the analytic profile; 0 on the stand-in [bytes]."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def buffer_bytes(self) -> int:
        """The sum of V_l: every layer's buffers."""
        return sum(x.buffer_bytes for x in self.layers)

    def check_values(self) -> list[Problem]:
        return [
            *(p for name in ("model", "device", "dtype") for p in non_empty(self, name, _WRITE_FIX)),
            *at_least(self, "microbatch_size", 1, _WRITE_FIX),
            *at_least(self, "seq_len", 1, _WRITE_FIX),
            *(
                p
                for name in ("input_bytes", "target_bytes", "library_bytes")
                for p in at_least(self, name, 0, _WRITE_FIX)
            ),
            *([] if self.layers else [Problem("layers", "a non-empty list of layers", "an empty list", _WRITE_FIX)]),
        ]

    def to_dict(self) -> dict:
        """Plain data of every field; from_dict (and a profile file) takes it back exactly."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "<dict>") -> Profile:
        """Same as profile_from_file_dict."""
        return profile_from_file_dict(d, where)


@dataclass(frozen=True)
class LayerRun(_ProfilePart):
    """`count` consecutive copies of `layer`: an item of a profile file's "runs"."""

    count: int
    layer: LayerProfile

    def check_values(self) -> list[Problem]:
        return at_least(self, "count", 1, "drop runs of no layers; a run has at least one")


def compress(profile: Profile | tuple[LayerProfile, ...] | list[LayerProfile]) -> list[tuple[LayerProfile, int]]:
    """Runs of consecutive identical layers, in order, each with its count (layer-similarity compression)."""
    layers = profile.layers if isinstance(profile, Profile) else profile
    runs: list[tuple[LayerProfile, int]] = []
    for layer in layers:
        if runs and runs[-1][0] == layer:
            runs[-1] = (layer, runs[-1][1] + 1)
        else:
            runs.append((layer, 1))
    return runs


def expand(runs) -> tuple[LayerProfile, ...]:
    """The layers of `runs` ((layer, count) pairs), each repeated count times: the inverse of compress."""
    out: list[LayerProfile] = []
    for layer, count in runs:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"a run's count must be a positive integer, found {count!r}")
        out += [layer] * count
    return tuple(out)


def runs_to_list(profile: Profile) -> list[dict]:
    """compress(profile) as plain data: [{"count": n, "layer": {...}}, ...] (the files' "runs" key)."""
    return [to_plain(LayerRun(count=n, layer=x)) for x, n in compress(profile)]


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write Profile.to_dict() as YAML (or JSON when the suffix is .json); load_profile reads it back exactly."""
    save_file(profile.to_dict(), path)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file (JSON when the suffix is .json, else YAML); ProfileFileError lists anything malformed."""
    where = f"profile {path}"
    fix = f"write one with `mobiuspipe profile --model NAME -o {Path(path).name}`"
    return profile_from_file_dict(read_file(path, where=where, error=ProfileFileError, fix=fix), where)


def profile_from_file_dict(d: Any, where: str = "profile") -> Profile:
    """A Profile from a loaded file's mapping (layers, runs or both); ProfileFileError names `where` and
    lists every problem."""
    builder = Builder(where, ProfileFileError)
    data = dict(d) if isinstance(d, dict) else d
    if not isinstance(data, dict) or "runs" not in data:
        return builder.finish(builder.build(Profile, data))
    runs = builder.value(tuple[LayerRun, ...], data.pop("runs"), "runs")
    if runs == ():
        builder.add([Problem("runs", "a non-empty list of runs", "an empty list", _WRITE_FIX)])
    layers = INVALID if runs in (INVALID, ()) else expand((r.layer, r.count) for r in runs)
    profile = builder.build(Profile, data, extra={} if "layers" in data else {"layers": layers})
    if profile is not INVALID and layers is not INVALID and profile.layers != layers:
        builder.add(
            [
                Problem(
                    "runs",
                    "the layers that `layers` lists",
                    f"runs that disagree with layers: "
                    f"{len(layers)} layers against {len(profile.layers)}, or different ones",
                    "keep one of runs and layers",
                )
            ]
        )
    return builder.finish(profile)
