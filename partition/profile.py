"""Per-layer profile of a model: bytes and seconds of each layer, the numbers every planner reads.

Symbols (per layer l, for ONE microbatch of `microbatch_size` sequences of `seq_len` tokens):
  P_l  param_bytes       bytes of the layer's parameters in the dtype loaded into the GPU     [bytes]
  A_l  activation_bytes  activations the layer keeps for its backward pass                    [bytes]
  O_l  output_bytes      the layer's output tensor, what crosses a stage boundary              [bytes]
  F_l  fwd_s             forward time                                                          [s]
  B_l  bwd_s             backward time (input and weight gradients, no recomputation)          [s]

Layer-similarity compression (Mobius, "Profiling"): a transformer's blocks are identical, so a profile
is stored and solved as runs of consecutive identical layers, (layer, count); `expand` undoes it.
Files (save_profile/load_profile) are YAML, or JSON by suffix, holding Profile.to_dict(); a file may
also carry "runs" (a list of {"count", "layer"}), which is checked against "layers", or stands in for
"layers" when that key is absent.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from partition.errors import ProfileFileError
from partition.files import read_data, write_data

__all__ = ["LayerProfile", "Profile", "ProfileFileError", "compress", "expand", "load_profile", "runs_to_list",
           "profile_from_file_dict", "save_profile"]


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


def compress(profile: "Profile | tuple[LayerProfile, ...] | list[LayerProfile]") -> list[tuple[LayerProfile, int]]:
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
    return [{"count": n, "layer": asdict(x)} for x, n in compress(profile)]


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write Profile.to_dict() as YAML (or JSON when the suffix is .json); load_profile reads it back exactly."""
    write_data(profile.to_dict(), path)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file (JSON when the suffix is .json, else YAML); ProfileFileError on anything malformed."""
    path = Path(path)
    d = read_data(path, ProfileFileError, "profile", f"`mobiuspipe profile --model NAME -o {path.name}`")
    return profile_from_file_dict(d, f"profile file {path}")


_PROFILE_KEYS = {"model": str, "device": str, "dtype": str, "microbatch_size": int, "seq_len": int}


def _check_keys(d, expected: list[str], optional: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise ProfileFileError(f"{where}: expected a mapping with keys {', '.join(expected)}, "
                               f"found {type(d).__name__}")
    unknown = [k for k in d if k not in expected and k not in optional]
    if unknown:
        raise ProfileFileError(f"{where}: unknown key {unknown[0]!r}; expected keys: "
                               f"{', '.join([*expected, *sorted(optional)])}")
    missing = [k for k in expected if k not in d]
    if missing:
        raise ProfileFileError(f"{where}: missing key {missing[0]!r}")


def _value(v, kind: type, key: str, where: str):
    """v checked against kind: str non-empty, int >= 0 (not bool), float finite >= 0 (ints accepted)."""
    if kind is str:
        ok = isinstance(v, str) and v != ""
        expected = "a non-empty string"
    elif kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        expected = "an integer >= 0"
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        expected = "a finite number >= 0"
        v = float(v) if ok else v
    if not ok:
        raise ProfileFileError(f"{where}: key {key!r} expected {expected}, found {v!r}")
    return v


def _layer_from(d, where: str) -> LayerProfile:
    names = [f.name for f in fields(LayerProfile)]
    _check_keys(d, names, set(), where)
    kinds = {f.name: {"str": str, "int": int, "float": float}[f.type] for f in fields(LayerProfile)}
    return LayerProfile(**{k: _value(d[k], kinds[k], k, where) for k in names})


def _layers_from(d: dict, where: str) -> tuple[LayerProfile, ...]:
    layers = None
    if "layers" in d:
        if not isinstance(d["layers"], list) or not d["layers"]:
            raise ProfileFileError(f"{where}: key 'layers' expected a non-empty list, found {d['layers']!r}")
        layers = tuple(_layer_from(x, f"{where}, layers[{i}]") for i, x in enumerate(d["layers"]))
    if "runs" in d:
        runs = d["runs"]
        if not isinstance(runs, list) or not runs:
            raise ProfileFileError(f"{where}: key 'runs' expected a non-empty list, found {runs!r}")
        pairs = []
        for i, r in enumerate(runs):
            _check_keys(r, ["count", "layer"], set(), f"{where}, runs[{i}]")
            if _value(r["count"], int, "count", f"{where}, runs[{i}]") < 1:
                raise ProfileFileError(f"{where}, runs[{i}]: key 'count' expected an integer >= 1, found 0")
            pairs.append((_layer_from(r["layer"], f"{where}, runs[{i}].layer"), r["count"]))
        if layers is not None and expand(pairs) != layers:
            raise ProfileFileError(f"{where}: keys 'runs' and 'layers' disagree; keep one of them")
        layers = expand(pairs)
    return layers


def profile_from_file_dict(d, where: str = "profile") -> Profile:
    """A Profile from a loaded file's mapping (layers or runs); ProfileFileError names `where` and the key."""
    expected = [*_PROFILE_KEYS, "layers"]
    _check_keys(d, [*_PROFILE_KEYS], {"layers", "runs"}, where)
    if "layers" not in d and "runs" not in d:
        raise ProfileFileError(f"{where}: missing key 'layers' (or 'runs'); expected keys: {', '.join(expected)}")
    top = {k: _value(d[k], kind, k, where) for k, kind in _PROFILE_KEYS.items()}
    for k in ("microbatch_size", "seq_len"):
        if top[k] < 1:
            raise ProfileFileError(f"{where}: key {k!r} expected an integer >= 1, found {top[k]!r}")
    return Profile(**top, layers=_layers_from(d, where))
