"""The checks of a layout file's parts and of the whole layout (references, order, shapes), for the loader."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

from foundation.loader import Problem, at_least, field_hints, found_text, non_empty, positive, rule, to_plain
from topology.presets import STANDIN_NAME
from topology.types import P2P_STATUSES, Gpu, Measured, NvLink, Nvme, RootComplex, Switch, Topology

__all__ = ["LAYOUT_CHECKS"]

_FIX = "correct the layout file (`mobiuspipe topology --save FILE.yaml` writes one for this machine)"
_BANDWIDTH = "a bandwidth in GB/s, a finite number"


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
    """The check of a part of `cls`: its names, its bandwidth field `bandwidth`, its numa node and PCIe link."""
    return lambda obj: [*_names(obj, cls), *_bandwidth(obj, bandwidth), *_counts(obj)]


def _tflops(obj: SimpleNamespace) -> list[Problem]:
    """A gpu's tflops and fp32_tflops are 0 (the table's) or more."""
    fixes = {
        "tflops": "write its peak dense fp16/bf16 TFLOPS from the vendor's datasheet (e.g. 165.2), or 0 (the table's)",
        "fp32_tflops": "write its dense fp32 TFLOPS (CUDA cores, no TF32) from its datasheet (e.g. 82.6), or 0",
    }
    return [p for key, fix in fixes.items() if key in vars(obj) for p in at_least(obj, key, 0, fix)]


LEAST_GPU_BYTES = 64 * 2**20
"""The least memory_bytes a layout's gpu may have (0 = unknown, and CPU stand-ins, whose budgets tests make tiny,
aside): a bare number is bytes, so `memory_bytes: 24` (meant as 24 GiB) is refused rather than planned for as a
24-byte gpu."""


def _gpu_memory(obj: SimpleNamespace) -> list[Problem]:
    """A gpu's memory_bytes is 0 (unknown) or at least LEAST_GPU_BYTES (a CPU stand-in's any budget)."""
    n = vars(obj).get("memory_bytes")
    if not isinstance(n, int) or n == 0 or n >= LEAST_GPU_BYTES or vars(obj).get("name") == STANDIN_NAME:
        return []
    return [
        Problem(
            "memory_bytes",
            f"a gpu's memory in bytes: 0 (unknown) or at least {LEAST_GPU_BYTES} (64 MiB)",
            f"{n} bytes",
            f"a bare number is bytes: write the unit, e.g. `memory_bytes: {n}GiB`",
        )
    ]


def _counts(obj: SimpleNamespace) -> list[Problem]:
    """A numa node is -1 (unknown, as sysfs says) or more; a PCIe generation and width 0 (unknown) or more."""
    return [
        *(
            at_least(obj, "numa_node", -1, "write the NUMA node (0, 1, ...), or -1 if unknown")
            if "numa_node" in vars(obj)
            else []
        ),
        *(
            q
            for name in ("pcie_gen", "pcie_width")
            if name in vars(obj)
            for q in at_least(obj, name, 0, f"write the link's {name.split('_')[1]} (e.g. 4 and 16), or 0 if unknown")
        ),
    ]


def _nvlink(link: SimpleNamespace) -> list[Problem]:
    return [*at_least(link, "links", 1, "write how many NVLinks join the pair (1 or more)"), *_bandwidth(link, "gbps")]


def _measured(m: SimpleNamespace) -> list[Problem]:
    fix = "write 0 for not measured, or run `mobiuspipe topology --probe`"
    per_gpu = [
        (f"{name}[{i}]", v) for name in ("h2d_gbps", "h2d_group_gbps") for i, v in enumerate(getattr(m, name))
    ] + [(f"d2d_gbps[{a}][{b}]", v) for a, row in enumerate(m.d2d_gbps) for b, v in enumerate(row)]
    return [
        *(
            p
            for name in (
                "ssd_read_gbps",
                "ssd_write_gbps",
                "host_adam_params_per_s",
                "host_cores",
                "message_latency_s",
                "message_gbps",
                "message_send_s",
                "message_recv_s",
                "step_overhead_s",
            )
            for p in positive(m, name, fix, zero_ok=True)
        ),
        *(
            Problem(key, f"{_BANDWIDTH} >= 0 (0 = not measured)", found_text(v), fix)
            for key, v in per_gpu
            if not (math.isfinite(v) and v >= 0)
        ),
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
    Gpu: lambda obj: [*_part_check(Gpu, "link_gbps")(obj), *_tflops(obj), *_gpu_memory(obj)],
    Nvme: _part_check(Nvme, "link_gbps"),
    NvLink: _nvlink,
    Measured: _measured,
    Topology: _topology,
}
"""The checks of a layout's parts for foundation.loader (`checks=`): a file that embeds a layout (a plan) uses them
with topology.layout.layout_defaults to read it as strictly as a layout file."""
