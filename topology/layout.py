"""Layout files: a Topology read from and written to YAML or JSON, with strict checks that name the file and key.

A layout file holds what `Topology.to_dict()` produces:

    name: my-server                  # required
    source: file:my-server.yaml      # optional; default "file:<path>"
    host_memory_bytes: 512GiB        # optional; default 0 (unknown)
    root_complexes:                  # required, at least one
      - {name: rc0, numa_node: 0, uplink_gbps: 15.75}
    switches:                        # optional: PCIe switches (GPUs below one share its uplink)
      - {name: sw0, root_complex: rc0, uplink_gbps: 15.75}   # parent: another switch, optional
    gpus:                            # required, at least one, in index order
      - name: NVIDIA GeForce RTX 3090 Ti
        memory_bytes: 24GiB          # an int of bytes, or a string "24GiB" (2**30) / "24GB" (10**9)
        pci_bus_id: "0000:1a:00.0"
        root_complex: rc0            # must name one of root_complexes
        link_gbps: 15.75
        switch: sw0                  # optional; "" (default) = directly on a root port
        index: 0                     # optional; default its position, and must equal it
        numa_node: 0                 # optional; default the numa node of its root complex
        # optional too: uuid, pcie_gen, pcie_width, cpu_affinity ("0-11,24-35")
    nvlinks: [{a: 0, b: 1, links: 4, gbps: 56.0}]            # optional
    p2p: [[X, OK], [OK, X]]          # optional nvidia-smi P2P statuses per gpu pair; [] = none
    nvme: []                         # optional: {name, pci_bus_id, root_complex, numa_node, link_gbps, ...}
    measured: null                   # optional: what `mobiuspipe topology --probe` measured

Memory strings take B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), with an
optional space and a decimal number ("1.5 TiB"); they must come to a whole number of bytes.
Bandwidths are GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from topology.errors import TopologyError
from topology.presets import PRESETS
from topology.types import P2P_STATUSES, Gpu, Measured, RootComplex, Switch, Topology

__all__ = ["topology_from_dict", "load_topology", "save_topology", "parse_bytes"]

_SUFFIXES = (".yaml", ".yml", ".json")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
_MEMORY_HELP = 'bytes as an integer or a string like "24GiB" or "24GB"'
_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _fail(where: str, key: str, expected: str, found: Any) -> TopologyError:
    return TopologyError(f"{where}: {key}: expected {expected}, found {_describe(found)}")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, str) else repr(value)


def _check_keys(d: Any, where: str, key: str, required: tuple, optional: tuple = ()) -> None:
    """Fail on a non-mapping, on an unknown key (suggesting the nearest known one) and on a missing key."""
    if not isinstance(d, dict):
        raise _fail(where, key or "top level", "a mapping", d)
    prefix = f"{key}." if key else ""
    known = required + optional
    for k in d:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TopologyError(f"{where}: {prefix}{k}: unknown key; expected one of {list(known)}{hint}")
    for k in required:
        if k not in d:
            raise TopologyError(f"{where}: {prefix}{k}: missing key; expected the keys {list(required)}, "
                                f"found {sorted(map(str, d))}")


def parse_bytes(value: Any, where: str, key: str) -> int:
    """Bytes from an int or a string like "24GiB", "24 GB", "1.5TiB"; TopologyError naming `where` and `key`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _fail(where, key, f"{_MEMORY_HELP}, >= 0", value)
        return value
    m = _BYTES_RE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get(m.group(2).upper()) if m else None
    if unit is None:
        raise _fail(where, key, f"{_MEMORY_HELP} (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)", value)
    try:
        exact = Decimal(m.group(1)) * unit
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise _fail(where, key, _MEMORY_HELP, value) from None
    if exact != exact.to_integral_value():
        raise _fail(where, key, f"a whole number of bytes ({value} is {exact} bytes)", value)
    return int(exact)


def _value(hint: Any, v: Any, where: str, key: str) -> Any:
    """v converted to the field type `hint`, or TopologyError naming the key and what was expected."""
    if hint is type(None) or v is None:
        if v is None and (hint is type(None) or type(None) in typing.get_args(hint)):
            return None
        raise _fail(where, key, "a value", v)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _value(next(a for a in args if a is not type(None)), v, where, key)
    if typing.get_origin(hint) is tuple:
        if not isinstance(v, (list, tuple)):
            raise _fail(where, key, "a list", v)
        return tuple(_value(args[0], x, where, f"{key}[{i}]") for i, x in enumerate(v))
    if dataclasses.is_dataclass(hint):
        return _build(hint, v, where, key)
    if key.endswith("_bytes") and hint is int:
        return parse_bytes(v, where, key)
    is_int = isinstance(v, int) and not isinstance(v, bool)
    ok = isinstance(v, hint) and not (isinstance(v, bool) and hint is not bool) or hint is float and is_int
    bandwidth = key.endswith("gbps")
    if not ok or bandwidth and not key.startswith("measured.") and v <= 0:  # measured: 0 = not measured
        raise _fail(where, key, "a bandwidth in GB/s, a number > 0" if bandwidth else _SCALARS.get(hint, str(hint)), v)
    return float(v) if hint is float else v


def _build(cls: type, d: Any, where: str, key: str, defaults: dict | None = None) -> Any:
    """A frozen dataclass from a mapping: every field typed and checked, unknown and missing keys named."""
    fields = dataclasses.fields(cls)
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING and f.name not in (defaults or {}))
    optional = tuple(f.name for f in fields if f.name not in required)
    _check_keys(d, where, key, required, optional)
    hints = typing.get_type_hints(cls)
    prefix = f"{key}." if key else ""
    merged = {**(defaults or {}), **d}
    for k in required:  # a name or id that is required must say something
        if hints[k] is str and merged[k] == "":
            raise _fail(where, prefix + k, "a non-empty string", "")
    return cls(**{k: _value(hints[k], v, where, prefix + k) for k, v in merged.items()})


def _gpu_defaults(d: Any, i: int, rcs: dict[str, RootComplex]) -> dict:
    """index defaults to the position; numa_node to that of the gpu's root complex."""
    rc = rcs.get(d.get("root_complex")) if isinstance(d, dict) else None
    return {"index": i, **({"numa_node": rc.numa_node} if rc else {})}


def topology_from_dict(d: dict, where: str) -> Topology:
    """A Topology from a layout mapping (see the module docstring); TopologyError names `where` and the key."""
    names = tuple(f.name for f in dataclasses.fields(Topology))
    _check_keys(d, where, "", ("name", "gpus", "root_complexes"), names[4:] + ("source",))
    for k in ("root_complexes", "gpus"):
        if not isinstance(d[k], list) or not d[k]:
            raise _fail(where, k, "a non-empty list", d[k])
    if d["name"] == "":
        raise _fail(where, "name", "a non-empty string", "")
    rcs: dict[str, RootComplex] = {}
    for i, r in enumerate(_value(tuple[RootComplex, ...], d["root_complexes"], where, "root_complexes")):
        if r.name in rcs:
            raise _fail(where, f"root_complexes[{i}].name", f"a name no other root complex has, not one of {list(rcs)}",
                        r.name)
        rcs[r.name] = r
    gpus = tuple(_build(Gpu, g, where, f"gpus[{i}]", _gpu_defaults(g, i, rcs)) for i, g in enumerate(d["gpus"]))
    for i, g in enumerate(gpus):
        if g.index != i:
            raise _fail(where, f"gpus[{i}].index", f"{i} (gpus are listed in index order, 0..N-1)", g.index)
    hints = typing.get_type_hints(Topology)
    rest = {k: _value(hints[k], v, where, k) for k, v in d.items() if k not in ("gpus", "root_complexes")}
    _check_references(where, list(rcs), gpus, rest)
    try:
        return Topology(**{"source": f"file:{where}", **rest, "gpus": gpus, "root_complexes": tuple(rcs.values())})
    except TopologyError as e:  # the remaining cross-field checks live in Topology itself
        raise TopologyError(f"{where}: {e}") from e


def _check_references(where: str, rcs: list[str], gpus: tuple[Gpu, ...], rest: dict) -> None:
    """Names that must exist (switches, parents, root complexes), nvlink gpus and the p2p shape, by dotted key."""
    sws = _check_switches(where, rcs, rest.get("switches", ()))
    under = {s.name: s.root_complex for s in rest.get("switches", ())}
    attached = [*((f"gpus[{i}]", g) for i, g in enumerate(gpus)),
                *((f"nvme[{i}]", x) for i, x in enumerate(rest.get("nvme", ())))]
    for key, x in attached:
        _refer(where, f"{key}.root_complex", x.root_complex, rcs, "root_complexes")
        _refer(where, f"{key}.switch", x.switch, sws, "switches", optional=True)
        if x.switch and under[x.switch] != x.root_complex:
            raise _fail(where, f"{key}.root_complex", f"{under[x.switch]!r}, the root complex of its switch "
                        f"{x.switch!r}", x.root_complex)
    n = len(gpus)
    for i, link in enumerate(rest.get("nvlinks", ())):
        for end, v in (("a", link.a), ("b", link.b)):
            if not 0 <= v < n or (end == "b" and v == link.a):
                raise _fail(where, f"nvlinks[{i}].{end}", f"a gpu index in 0..{n - 1}, with a != b", v)
        if link.links < 1:
            raise _fail(where, f"nvlinks[{i}].links", "a number of NVLinks >= 1", link.links)
    _check_measured(where, rest.get("measured"), n)
    p2p = rest.get("p2p", ())
    if p2p and len(p2p) != n:
        raise _fail(where, "p2p", f"[] or a {n} x {n} matrix of statuses (a row per gpu)", [list(r) for r in p2p])
    for i, row in enumerate(p2p):
        if len(row) != n:
            raise _fail(where, f"p2p[{i}]", f"a row of {n} statuses (one per gpu)", list(row))
        for j, status in enumerate(row):
            if status not in P2P_STATUSES:
                raise _fail(where, f"p2p[{i}][{j}]", f"one of the nvidia-smi statuses {list(P2P_STATUSES)}", status)


def _check_measured(where: str, m: Measured | None, n: int) -> None:
    """Per-gpu measurements hold nothing or one value per gpu (d2d: n rows of n)."""
    for key in ("h2d_gbps", "h2d_group_gbps", "d2d_gbps"):
        v = getattr(m, key) if m else ()
        if v and (len(v) != n or key == "d2d_gbps" and any(len(row) != n for row in v)):
            shape = f"{n} rows of {n} values" if key == "d2d_gbps" else f"{n} values"
            raise _fail(where, f"measured.{key}", f"[] (not measured) or {shape}, one per gpu", list(v))


def _check_switches(where: str, rcs: list[str], switches: tuple[Switch, ...]) -> list[str]:
    """Switch names distinct, their root complex and parent existing, no loop of parents; returns the names."""
    sws = [s.name for s in switches]
    for i, s in enumerate(switches):
        if s.name in sws[:i]:
            raise _fail(where, f"switches[{i}].name", f"a name no other switch has, not one of {sws[:i]}", s.name)
        _refer(where, f"switches[{i}].root_complex", s.root_complex, rcs, "root_complexes")
        _refer(where, f"switches[{i}].parent", s.parent, sws, "switches", optional=True)
        if s.parent and switches[sws.index(s.parent)].root_complex != s.root_complex:
            raise _fail(where, f"switches[{i}].root_complex", "the root complex of its parent switch "
                        f"{s.parent!r}", s.root_complex)
        up, seen = s.parent, {s.name}
        while up in sws and up not in seen:
            seen.add(up)
            up = switches[sws.index(up)].parent
        if up in seen:
            raise _fail(where, f"switches[{i}].parent", f"a switch that is not below {s.name!r} (parents form a loop)",
                        s.parent)
    return sws


def _refer(where: str, key: str, name: str, known: list[str], what: str, optional: bool = False) -> None:
    if not (optional and name == "") and name not in known:
        empty = ' or "" for none' if optional else ""
        raise _fail(where, key, f"one of the {what} {known}{empty}", name)


def _read(path: Path) -> Any:
    """The parsed content of a .yaml/.yml/.json file; TopologyError on an unreadable or malformed file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"{path}: cannot read the layout file: {e}") from e
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise TopologyError(f"{path}: malformed YAML{at}: {problem}") from e


def load_topology(spec: str) -> Topology:
    """The preset called `spec`, or the layout in the .yaml/.yml/.json file at path `spec`."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is neither a preset nor an existing file"
        raise TopologyError(f"topology {spec!r} {what}; known presets: {sorted(PRESETS)}, "
                            f"or give the path of a {'/'.join(_SUFFIXES)} layout file")
    if path.suffix not in _SUFFIXES:
        raise TopologyError(f"{path}: expected a layout file ending in {'/'.join(_SUFFIXES)}, "
                            f"found suffix {path.suffix!r}; rename it or convert it")
    data = _read(path)
    if not isinstance(data, dict):
        raise _fail(str(path), "top level", "a mapping with keys name, gpus, root_complexes", data)
    return topology_from_dict(data, str(path))


def save_topology(t: Topology, path: str | Path) -> Path:
    """Write `t` as YAML (.yaml/.yml) or JSON (.json) so that `load_topology(path) == t`; returns the path."""
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise TopologyError(f"{path}: cannot save a topology with suffix {path.suffix!r}; "
                            f"expected one of {list(_SUFFIXES)}")
    d = t.to_dict()
    if path.suffix == ".json":
        text = json.dumps(d, indent=2) + "\n"
    else:
        text = ("# mobiuspipe topology layout: memory in bytes (\"24GiB\" also accepted), bandwidth in GB/s\n"
                + yaml.safe_dump(d, sort_keys=False))
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise TopologyError(f"{path}: cannot write the layout file: {e}") from e
    return path
