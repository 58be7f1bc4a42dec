"""Layout files: a Topology read from and written to YAML or JSON, with strict checks that name the file and key.

A layout file holds what `Topology.to_dict()` produces:

    name: my-server                  # required
    source: file:my-server.yaml      # optional; default "file:<path>"
    host_memory_bytes: 512GiB        # optional; default 0 (unknown)
    p2p: false                       # optional; default false
    root_complexes:                  # required, at least one
      - {name: rc0, numa_node: 0, uplink_gbps: 15.75}
    gpus:                            # required, at least one, in index order
      - name: NVIDIA GeForce RTX 3090 Ti
        memory_bytes: 24GiB          # an int of bytes, or a string "24GiB" (2**30) / "24GB" (10**9)
        pci_bus_id: "00000000:1A:00.0"
        root_complex: rc0            # must name one of root_complexes
        link_gbps: 15.75
        index: 0                     # optional; default its position, and must equal it
        numa_node: 0                 # optional; default the numa node of its root complex

Memory strings take B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), with an
optional space and a decimal number ("1.5 TiB"); they must come to a whole number of bytes.
Bandwidths are GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import difflib
import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from topology.errors import TopologyError
from topology.presets import PRESETS
from topology.types import Gpu, RootComplex, Topology

__all__ = ["topology_from_dict", "load_topology", "save_topology", "parse_bytes"]

_TOP_REQUIRED = ("name", "gpus", "root_complexes")
_TOP_OPTIONAL = ("source", "host_memory_bytes", "p2p")
_RC_REQUIRED = ("name", "numa_node", "uplink_gbps")
_GPU_REQUIRED = ("name", "memory_bytes", "pci_bus_id", "root_complex", "link_gbps")
_GPU_OPTIONAL = ("index", "numa_node")
_SUFFIXES = (".yaml", ".yml", ".json")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
_MEMORY_HELP = 'bytes as an integer or a string like "24GiB" or "24GB"'


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


def _str(d: dict, k: str, where: str, key: str) -> str:
    if not isinstance(d[k], str) or not d[k]:
        raise _fail(where, key, "a non-empty string", d[k])
    return d[k]


def _int(d: dict, k: str, where: str, key: str) -> int:
    if not isinstance(d[k], int) or isinstance(d[k], bool):
        raise _fail(where, key, "an integer", d[k])
    return d[k]


def _gbps(d: dict, k: str, where: str, key: str) -> float:
    v = d[k]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise _fail(where, key, "a bandwidth in GB/s, a number > 0", v)
    return float(v)


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


def _root_complex(d: Any, where: str, key: str) -> RootComplex:
    _check_keys(d, where, key, _RC_REQUIRED)
    return RootComplex(name=_str(d, "name", where, f"{key}.name"),
                       numa_node=_int(d, "numa_node", where, f"{key}.numa_node"),
                       uplink_gbps=_gbps(d, "uplink_gbps", where, f"{key}.uplink_gbps"))


def _gpu(d: Any, i: int, rcs: dict[str, RootComplex], where: str) -> Gpu:
    key = f"gpus[{i}]"
    _check_keys(d, where, key, _GPU_REQUIRED, _GPU_OPTIONAL)
    rc_name = _str(d, "root_complex", where, f"{key}.root_complex")
    if rc_name not in rcs:
        raise _fail(where, f"{key}.root_complex", f"one of the root_complexes {list(rcs)}", rc_name)
    index = _int(d, "index", where, f"{key}.index") if "index" in d else i
    if index != i:
        raise _fail(where, f"{key}.index", f"{i} (gpus are listed in index order, 0..N-1)", index)
    numa = _int(d, "numa_node", where, f"{key}.numa_node") if "numa_node" in d else rcs[rc_name].numa_node
    memory = parse_bytes(d["memory_bytes"], where, f"{key}.memory_bytes")
    if memory <= 0:
        raise _fail(where, f"{key}.memory_bytes", "memory > 0", d["memory_bytes"])
    return Gpu(index=index, name=_str(d, "name", where, f"{key}.name"), memory_bytes=memory,
               pci_bus_id=_str(d, "pci_bus_id", where, f"{key}.pci_bus_id"), root_complex=rc_name,
               numa_node=numa, link_gbps=_gbps(d, "link_gbps", where, f"{key}.link_gbps"))


def _nonempty_list(d: dict, k: str, where: str) -> list:
    if not isinstance(d[k], list) or not d[k]:
        raise _fail(where, k, "a non-empty list", d[k])
    return d[k]


def topology_from_dict(d: dict, where: str) -> Topology:
    """A Topology from a layout mapping (see the module docstring); TopologyError names `where` and the key."""
    _check_keys(d, where, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    rc_list = [_root_complex(r, where, f"root_complexes[{i}]")
               for i, r in enumerate(_nonempty_list(d, "root_complexes", where))]
    rcs = {r.name: r for r in rc_list}
    if len(rcs) != len(rc_list):
        raise _fail(where, "root_complexes", "distinct names", [r.name for r in rc_list])
    gpus = tuple(_gpu(g, i, rcs, where) for i, g in enumerate(_nonempty_list(d, "gpus", where)))
    p2p = d.get("p2p", False)
    if not isinstance(p2p, bool):
        raise _fail(where, "p2p", "true or false", p2p)
    source = _str(d, "source", where, "source") if "source" in d else f"file:{where}"
    host = parse_bytes(d.get("host_memory_bytes", 0), where, "host_memory_bytes")
    try:
        return Topology(name=_str(d, "name", where, "name"), gpus=gpus, root_complexes=tuple(rc_list),
                        source=source, host_memory_bytes=host, p2p=p2p)
    except TopologyError as e:  # the remaining cross-field checks live in Topology itself
        raise TopologyError(f"{where}: {e}") from e


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
