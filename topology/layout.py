"""Layout files: a Topology read from and written to YAML or JSON by the one strict loader (foundation.loader).

A layout file holds what `Topology.to_dict()` produces (README.md shows this same schema, and a test loads it):

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
        link_gbps: 15.75             # GB/s of the gpu's own PCIe link, one direction
        switch: sw0                  # optional; "" (default) = directly on a root port
        index: 0                     # optional; default its position, and must equal it
        numa_node: 0                 # optional; default the numa node of its root complex
        # optional too: uuid, pcie_gen, pcie_width, cpu_affinity ("0-11,24-35")
      - {name: NVIDIA GeForce RTX 3090 Ti, memory_bytes: 24GiB, pci_bus_id: "0000:1b:00.0",
         root_complex: rc0, link_gbps: 15.75, switch: sw0}
    nvlinks: [{a: 0, b: 1, links: 4, gbps: 56.0}]            # optional
    p2p: [[X, OK], [OK, X]]          # optional nvidia-smi P2P statuses per gpu pair; [] = none
    nvme:                            # optional: drives for the SSD tier (switch, model: optional)
      - {name: nvme0, pci_bus_id: "0000:3d:00.0", root_complex: rc0, numa_node: 0, link_gbps: 7.88}
    measured: null                   # optional: what `mobiuspipe topology --probe` measured: h2d_gbps,
                                     # h2d_group_gbps (per gpu), d2d_gbps (gpu x gpu), ssd_dir, ssd_read_gbps,
                                     # ssd_write_gbps, host_adam_params_per_s, notes
    notes: []                        # optional: what discovery could not find out

Memory strings take B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), with an
optional space and a decimal number ("1.5 TiB"); they must come to a whole number of bytes.
Bandwidths are GB/s (1e9 bytes per second). Every problem of a file is reported at once, in one error, each
with its dotted key (`gpus[2].memory_bytes`), what was expected, what was found and the fix: all the missing
keys of every part, not the first alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from foundation.loader import (
    Problem,
    at_least,
    field_hints,
    format_problems,
    found_text,
    from_plain,
    non_empty,
    positive,
    read_file,
    rule,
    save_file,
    to_plain,
)
from foundation.units import as_bytes
from topology.errors import TopologyError
from topology.presets import PRESETS
from topology.types import P2P_STATUSES, Gpu, Measured, NvLink, Nvme, RootComplex, Switch, Topology

__all__ = ["topology_from_dict", "load_topology", "save_topology", "parse_bytes", "LAYOUT_CHECKS", "layout_defaults"]

_SUFFIXES = (".yaml", ".yml", ".json")
_HEADER = '# mobiuspipe topology layout: memory in bytes ("24GiB" also accepted), bandwidth in GB/s\n'
_FIX = "correct the layout file (`mobiuspipe topology --save FILE.yaml` writes one for this machine)"
_BANDWIDTH = "a bandwidth in GB/s, a finite number"


def parse_bytes(value: Any, where: str, key: str) -> int:
    """Bytes from an int or a string like "24GiB", "24 GB", "1.5TiB"; TopologyError naming `where` and `key`."""
    try:
        return as_bytes(value)
    except ValueError as e:
        fix = f"write bytes, or a size with its unit such as `{key.rsplit('.', 1)[-1]}: 24GiB`"
        raise TopologyError(format_problems(where, [Problem(key, str(e), found_text(value), fix)])) from None


# ---- checks of single parts: names say something, bandwidths are > 0 ----


def _names(obj: SimpleNamespace, cls: type) -> list[Problem]:
    """Every required text field of `cls` (a name, a bus id, a root complex) is non-empty."""
    hints = field_hints(cls)
    return [
        p
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and hints[f.name] is str
        for p in non_empty(obj, f.name, f"write the {f.name.replace('_', ' ')} it has in the machine")
    ]


def _bandwidth(obj: SimpleNamespace, name: str) -> list[Problem]:
    return positive(obj, name, "write the link's GB/s, e.g. 15.75 for PCIe 3.0 x16", what=_BANDWIDTH)


def _part_check(cls: type, bandwidth: str) -> Any:
    """The check of a part of `cls`: its names, and its bandwidth field `bandwidth`."""
    return lambda obj: [*_names(obj, cls), *_bandwidth(obj, bandwidth)]


def _nvlink(link: SimpleNamespace) -> list[Problem]:
    return [*at_least(link, "links", 1, "write how many NVLinks join the pair (1 or more)"), *_bandwidth(link, "gbps")]


def _measured(m: SimpleNamespace) -> list[Problem]:
    fix = "write 0 for not measured, or run `mobiuspipe topology --probe`"
    return [
        p
        for name in ("ssd_read_gbps", "ssd_write_gbps", "host_adam_params_per_s")
        for p in positive(m, name, fix, zero_ok=True)
    ]


# ---- checks across the whole layout: references, order, shapes ----


def _topology(t: SimpleNamespace) -> list[Problem]:
    """Every rule that spans parts: non-empty lists, unique names, references, gpu order, shapes."""
    rcs = [r.name for r in t.root_complexes]
    return [
        *non_empty(t, "name", "name the machine, e.g. `name: my-server`"),
        *(
            p
            for key in ("gpus", "root_complexes")
            for p in rule(
                bool(getattr(t, key)), key, f"a non-empty list of {key.replace('_', ' ')}", "an empty list", _FIX
            )
        ),
        *_unique("root_complexes", rcs, "root complex"),
        *_switches(t.switches, rcs),
        *_gpu_order(t.gpus),
        *_attachments(t),
        *_nvlinks(t.nvlinks, len(t.gpus)),
        *_measured_shapes(t.measured, len(t.gpus)),
        *_p2p(t.p2p, len(t.gpus)),
    ]


def _unique(key: str, names: list[str], what: str) -> list[Problem]:
    """Names listed under `key` must be distinct."""
    return [
        Problem(
            f"{key}[{i}].name",
            f"a name no other {what} has, not one of {names[:i]}",
            found_text(name),
            f"rename it or delete the repeated {what}",
        )
        for i, name in enumerate(names)
        if name in names[:i]
    ]


def _refer(key: str, name: str, known: list[str], what: str, optional: bool = False) -> list[Problem]:
    """`name` at `key` must be one of `known` (or "" when `optional`)."""
    empty = ' or "" for none' if optional else ""
    return rule(
        optional and name == "" or name in known,
        key,
        f"one of the {what} {known}{empty}",
        found_text(name),
        f"use a name listed under {what}, or add it there",
    )


def _switches(switches: tuple[Switch, ...], rcs: list[str]) -> list[Problem]:
    """Switch names distinct, their root complex and parent existing and agreeing, no loop of parents."""
    names = [s.name for s in switches]
    problems = _unique("switches", names, "switch")
    for i, s in enumerate(switches):
        problems += _refer(f"switches[{i}].root_complex", s.root_complex, rcs, "root_complexes")
        problems += _refer(f"switches[{i}].parent", s.parent, names, "switches", optional=True)
        parent = switches[names.index(s.parent)] if s.parent in names else None
        if parent and parent.root_complex in rcs and s.root_complex in rcs and parent.root_complex != s.root_complex:
            problems.append(
                Problem(
                    f"switches[{i}].root_complex",
                    f"the root complex of its parent switch {s.parent!r}, {parent.root_complex!r}",
                    found_text(s.root_complex),
                    "a switch hangs below one root complex: make the two agree",
                )
            )
        if _in_loop(s, switches, names):
            problems.append(
                Problem(
                    f"switches[{i}].parent",
                    f"a switch that is not below {s.name!r} (parents form a loop)",
                    found_text(s.parent),
                    'make the parents lead up to a root complex: the top switch has parent ""',
                )
            )
    return problems


def _in_loop(s: Switch, switches: tuple[Switch, ...], names: list[str]) -> bool:
    """True when following the parents up from switch `s` comes back to it."""
    up, seen = s.parent, {s.name}
    while up in names and up not in seen:
        seen.add(up)
        up = switches[names.index(up)].parent
    return up in seen


def _gpu_order(gpus: tuple[Gpu, ...]) -> list[Problem]:
    return [
        Problem(
            f"gpus[{i}].index",
            f"{i} (gpus are listed in index order, 0..N-1)",
            found_text(g.index),
            f"list the gpus in index order, or delete `index` (it defaults to the position, {i})",
        )
        for i, g in enumerate(gpus)
        if g.index != i
    ]


def _attachments(t: SimpleNamespace) -> list[Problem]:
    """Gpus and drives name an existing root complex and switch, and the switch's root complex is theirs."""
    rcs, under = [r.name for r in t.root_complexes], {}
    for s in t.switches:
        under.setdefault(s.name, s.root_complex)
    problems = []
    for key, x in [
        *((f"gpus[{i}]", g) for i, g in enumerate(t.gpus)),
        *((f"nvme[{i}]", d) for i, d in enumerate(t.nvme)),
    ]:
        problems += _refer(f"{key}.root_complex", x.root_complex, rcs, "root_complexes")
        problems += _refer(f"{key}.switch", x.switch, list(under), "switches", optional=True)
        known = x.root_complex in rcs and under.get(x.switch) in rcs  # else reported above or at the switch
        if known and under[x.switch] != x.root_complex:
            problems.append(
                Problem(
                    f"{key}.root_complex",
                    f"{under[x.switch]!r}, the root complex of its switch {x.switch!r}",
                    found_text(x.root_complex),
                    "make the two agree",
                )
            )
    return problems


def _nvlinks(links: tuple[NvLink, ...], n: int) -> list[Problem]:
    """Each NVLink joins two distinct gpus of the layout."""
    return [
        Problem(
            f"nvlinks[{i}].{end}",
            f"a gpu index in 0..{n - 1}, with a != b",
            found_text(v),
            "name two different gpus of this layout by index",
        )
        for i, link in enumerate(links)
        for end, v in (("a", link.a), ("b", link.b))
        if not 0 <= v < n or (end == "b" and v == link.a)
    ]


def _measured_shapes(m: Measured | None, n: int) -> list[Problem]:
    """Per-gpu measurements hold nothing or one value per gpu (d2d: n rows of n)."""
    problems = []
    for key in ("h2d_gbps", "h2d_group_gbps", "d2d_gbps"):
        v = getattr(m, key) if m else ()
        if v and (len(v) != n or key == "d2d_gbps" and any(len(row) != n for row in v)):
            shape = f"{n} rows of {n} values" if key == "d2d_gbps" else f"{n} values"
            problems.append(
                Problem(
                    f"measured.{key}",
                    f"[] (not measured) or {shape}, one per gpu",
                    found_text(to_plain(v)),
                    "probe again with `mobiuspipe topology --probe`",
                )
            )
    return problems


def _p2p(p2p: tuple[tuple[str, ...], ...], n: int) -> list[Problem]:
    """No statuses, or an n x n matrix of nvidia-smi statuses."""
    fix = "copy the matrix of `nvidia-smi topo -p2p r`, or write [] for none"
    if p2p and len(p2p) != n:
        return [Problem("p2p", f"[] or a {n} x {n} matrix of statuses (a row per gpu)", f"{len(p2p)} rows", fix)]
    problems = [
        Problem(f"p2p[{i}]", f"a row of {n} statuses (one per gpu)", found_text(list(row)), fix)
        for i, row in enumerate(p2p)
        if len(row) != n
    ]
    return problems + [
        Problem(f"p2p[{i}][{j}]", f"one of the nvidia-smi statuses {list(P2P_STATUSES)}", found_text(status), fix)
        for i, row in enumerate(p2p)
        for j, status in enumerate(row)
        if status not in P2P_STATUSES
    ]


LAYOUT_CHECKS = {
    RootComplex: _part_check(RootComplex, "uplink_gbps"),
    Switch: _part_check(Switch, "uplink_gbps"),
    Gpu: _part_check(Gpu, "link_gbps"),
    Nvme: _part_check(Nvme, "link_gbps"),
    NvLink: _nvlink,
    Measured: _measured,
    Topology: _topology,
}
"""The checks of a layout's parts for foundation.loader (`checks=`): a file that embeds a layout (a plan) uses them
with layout_defaults to read it as strictly as a layout file."""


# ---- reading and writing ----


def layout_defaults(d: Any, source: str) -> Any:
    """The layout with its optional defaults: source, and per gpu index (its position) and numa_node (that
    of its root complex)."""
    if not isinstance(d, dict):
        return d
    d = {"source": source, **d}
    if isinstance(d.get("gpus"), list):
        numa = _numa_nodes(d.get("root_complexes"))
        d["gpus"] = [_gpu_defaults(g, i, numa) for i, g in enumerate(d["gpus"])]
    return d


def _numa_nodes(rcs: Any) -> dict[str, int]:
    """Root complex name -> numa node, for the well-formed entries of a layout's root_complexes."""
    items = [r for r in rcs if isinstance(r, dict)] if isinstance(rcs, list) else []
    return {
        r["name"]: r["numa_node"] for r in items if isinstance(r.get("name"), str) and type(r.get("numa_node")) is int
    }


def _gpu_defaults(g: Any, i: int, numa: dict[str, int]) -> Any:
    """A gpu's mapping with `index` and `numa_node` filled in where it leaves them out. When its root complex's
    numa node cannot be known (the gpu names none, an unknown one, or one that is itself malformed), that is the
    problem reported, not the optional numa_node: the 0 put in its place never makes a file valid."""
    if not isinstance(g, dict):
        return g
    rc = g.get("root_complex")
    return {"index": i, "numa_node": numa.get(rc, 0) if isinstance(rc, str) else 0, **g}


def _layout(d: Any, where: str, source: str) -> Topology:
    return from_plain(Topology, layout_defaults(d, source), where=where, error=TopologyError, checks=LAYOUT_CHECKS)


def topology_from_dict(d: Any, where: str) -> Topology:
    """A Topology from a layout mapping (see the module docstring); TopologyError names `where` and lists
    every problem by its dotted key."""
    return _layout(d, where, f"file:{where}")


def load_topology(spec: str) -> Topology:
    """The preset called `spec`, or the layout in the .yaml/.yml/.json file at path `spec`."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is neither a preset nor an existing file"
        raise TopologyError(
            f"topology {spec!r} {what}; known presets: {sorted(PRESETS)}, "
            f"or give the path of a {'/'.join(_SUFFIXES)} layout file"
        )
    if path.suffix not in _SUFFIXES:
        raise TopologyError(
            f"{path}: expected a layout file ending in {'/'.join(_SUFFIXES)}, "
            f"found suffix {path.suffix!r}; rename it or convert it"
        )
    where = f"layout {path}"
    return _layout(read_file(path, where=where, error=TopologyError, fix=_FIX), where, f"file:{path}")


def save_topology(t: Topology, path: str | Path) -> Path:
    """Write `t` as YAML (.yaml/.yml) or JSON (.json) so that `load_topology(path) == t`; returns the path."""
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise TopologyError(
            f"{path}: cannot save a topology with suffix {path.suffix!r}; expected one of {list(_SUFFIXES)}"
        )
    try:
        return save_file(t.to_dict(), path, _HEADER)
    except OSError as e:
        raise TopologyError(f"{path}: cannot write the layout file: {e}") from e
