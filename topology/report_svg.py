"""The topology as a self-contained SVG picture: sockets, root complexes, switches, GPUs, NVMe, NVLinks, bandwidth."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from topology.errors import TopologyError
from topology.report import loads_gbps, memory_text, ranges, summary
from topology.types import Topology

__all__ = ["svg_topology", "svg_text"]

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
PALETTE = (
    ("#e8f0fe", "#1a73e8"),
    ("#feefe3", "#e8710a"),
    ("#f3e8fd", "#9334e6"),
    ("#e4f7fb", "#12859a"),
    ("#fde7f3", "#c5297f"),
    ("#f5ece6", "#8d5b3a"),
)
"""(light fill, strong colour) per contention group; group i takes PALETTE[i % 6]."""
GREY = ("#f1f3f4", "#5f6368")
NVLINK = "#76b900"
LEAF_W, GPU_H, NVME_H = 132, 72, 58
PAD, GAP, HEAD, WIRE = 12, 16, 38, 30
SOCKET_H, SOCKET_WIRE, SOCKET_GAP, RC_GAP = 42, 40, 64, 24
MARGIN, TOP, LANE_H, ROW_H = 20, 78, 30, 22
BAR_W = 170


@dataclass
class _Box:
    """A drawn box: a root complex, switch, GPU or NVMe; containers hold their children in a row."""

    kind: str
    lines: tuple[str, ...]
    up: str
    """Label of the wire to the parent (GB/s)."""
    colours: tuple[str, str]
    children: list[_Box] = field(default_factory=list)
    gpu: int = -1
    w: float = 0.0
    h: float = 0.0
    x: float = 0.0
    y: float = 0.0


def _text_w(text: str, size: float, bold: bool = False) -> float:
    """Estimated width of `text` in px (DejaVu Sans averages 0.6 em a character, bold 0.67)."""
    return len(text) * size * (0.67 if bold else 0.6)


def _gbps(x: float) -> str:
    return f"{x:.2f} GB/s"


def _short(name: str, limit: int = 18) -> str:
    for prefix in ("NVIDIA ", "GeForce ", "Tesla "):
        name = name.removeprefix(prefix)
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


def _gpu_box(t: Topology, i: int, colours: tuple[str, str]) -> _Box:
    g = t.gpus[i]
    link = f"gen{g.pcie_gen} x{g.pcie_width} \u00b7 " if g.pcie_gen and g.pcie_width else ""
    lines = (f"GPU {i}", _short(g.name), memory_text(g.memory_bytes), link + g.pci_bus_id.removeprefix("0000:"))
    return _Box("gpu", lines, _gbps(g.link_gbps), colours, gpu=i)


def _order(t: Topology, box: _Box) -> int:
    """Left-to-right order: by the lowest gpu index inside, NVMe drives last."""
    if box.kind == "gpu":
        return box.gpu
    inside = [_order(t, c) for c in box.children if c.kind != "nvme"]
    return min(inside, default=10**6)


def _below(t: Topology, rc: str, switch: str, colours: tuple[str, str]) -> list[_Box]:
    """Boxes right below `switch` ("" = the root complex's own ports), switches holding their own subtrees."""
    boxes = [_gpu_box(t, g.index, colours) for g in t.gpus if g.root_complex == rc and g.switch == switch]
    for s in (s for s in t.switches if s.root_complex == rc and s.parent == switch):
        lines = (f"{s.name} \u00b7 PCIe switch", f"uplink {_gbps(s.uplink_gbps)}")
        boxes.append(_Box("switch", lines, _gbps(s.uplink_gbps), colours, _below(t, rc, s.name, colours)))
    for d in (d for d in t.nvme if d.root_complex == rc and d.switch == switch):
        lines = (d.name, _short(d.model or "NVMe drive", 20), d.pci_bus_id.removeprefix("0000:"))
        boxes.append(_Box("nvme", lines, _gbps(d.link_gbps), GREY))
    return sorted(boxes, key=lambda b: _order(t, b))


def _rc_boxes(t: Topology) -> list[_Box]:
    groups = [rc.name for rc in t.root_complexes if any(g.root_complex == rc.name for g in t.gpus)]
    boxes = []
    for rc in t.root_complexes:
        colours = PALETTE[groups.index(rc.name) % len(PALETTE)] if rc.name in groups else GREY
        numa = f"NUMA {rc.numa_node}" if rc.numa_node >= 0 else "NUMA ?"
        lines = (f"{rc.name} \u00b7 root complex", f"{numa} \u00b7 uplink {_gbps(rc.uplink_gbps)}")
        boxes.append(_Box("rc", lines, _gbps(rc.uplink_gbps), colours, _below(t, rc.name, "", colours)))
    return boxes


def _measure(b: _Box) -> None:
    if b.kind in ("gpu", "nvme"):
        b.w, b.h = LEAF_W, GPU_H if b.kind == "gpu" else NVME_H
        return
    for c in b.children:
        _measure(c)
    row = sum(c.w for c in b.children) + GAP * (len(b.children) - 1)
    text = max(_text_w(b.lines[0], 12.5, bold=True), _text_w(b.lines[1], 10.5))
    b.w = max(row, text, LEAF_W) + 2 * PAD
    b.h = HEAD + (WIRE + max(c.h for c in b.children) if b.children else 12) + PAD


def _place(b: _Box, x: float, y: float) -> None:
    b.x, b.y = x, y
    row = sum(c.w for c in b.children) + GAP * (len(b.children) - 1)
    cx = x + (b.w - row) / 2
    for c in b.children:
        _place(c, cx, y + HEAD + WIRE)
        cx += c.w + GAP


def _text(
    x: float, y: float, s: str, size: float = 11, fill: str = "#202124", weight: str = "normal", anchor: str = "start"
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" font-weight="{weight}" '
        f'text-anchor="{anchor}">{escape(s)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str, width: float = 1.5, rx: int = 8) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{width}"/>'
    )


def _draw(b: _Box) -> list[str]:
    """The box, its header, the bus bar and labelled wires to its children, then the children."""
    light, strong = b.colours
    if b.kind == "gpu":
        out = [_rect(b.x, b.y, b.w, b.h, strong, strong, 1.5, 6)]
        out += [_text(b.x + b.w / 2, b.y + 18, b.lines[0], 13, "#ffffff", "bold", "middle")]
        out += [
            _text(b.x + b.w / 2, b.y + 34 + 14 * k, s, 11 if k < 2 else 10, "#ffffff", anchor="middle")
            for k, s in enumerate(b.lines[1:])
        ]
        return out
    if b.kind == "nvme":
        return [
            _rect(b.x, b.y, b.w, b.h, light, strong, 1.2, 6),
            *(
                _text(
                    b.x + b.w / 2,
                    b.y + 17 + 15 * k,
                    s,
                    12 if k == 0 else 10,
                    strong,
                    "bold" if k == 0 else "normal",
                    "middle",
                )
                for k, s in enumerate(b.lines)
            ),
        ]
    fill, width = (light, 2.0) if b.kind == "rc" else ("#ffffff", 1.2)
    out = [
        _rect(b.x, b.y, b.w, b.h, fill, strong, width),
        _text(b.x + PAD, b.y + 17, b.lines[0], 12.5, strong, "bold"),
        _text(b.x + PAD, b.y + 32, b.lines[1], 10.5),
    ]
    if not b.children:
        return out + [_text(b.x + PAD, b.y + HEAD + 8, "(nothing attached)", 10, "#80868b")]
    centres = [c.x + c.w / 2 for c in b.children]
    bar = b.y + HEAD + 2
    if len(centres) > 1:
        out.append(
            f'<line x1="{centres[0]:.1f}" y1="{bar}" x2="{centres[-1]:.1f}" y2="{bar}" stroke="{strong}" '
            f'stroke-width="3" stroke-linecap="round"/>'
        )
    for c, cx in zip(b.children, centres):
        out.append(f'<line x1="{cx:.1f}" y1="{bar}" x2="{cx:.1f}" y2="{c.y}" stroke="{strong}" stroke-width="1.5"/>')
        out.append(_text(cx + 5, (bar + c.y) / 2 + 4, c.up, 10, "#3c4043"))
        out += _draw(c)
    return out


def _sockets(t: Topology, rcs: list[_Box], top: float) -> tuple[list[str], float]:
    """Place the root complexes in a row under one box per NUMA node (socket); returns the drawing and width."""
    out, x, socket_boxes = [], float(MARGIN), []
    y_rc = top + SOCKET_H + SOCKET_WIRE
    for numa in dict.fromkeys(r.numa_node for r in t.root_complexes):
        name = f"CPU socket {numa} \u00b7 NUMA node {numa}" if numa >= 0 else "CPU socket \u00b7 NUMA node unknown"
        mine = [b for rc, b in zip(t.root_complexes, rcs) if rc.numa_node == numa]
        span = sum(b.w for b in mine) + RC_GAP * (len(mine) - 1)
        wide = max(span, _text_w(name, 12.5, bold=True) + 2 * PAD)
        cx = x + (wide - span) / 2
        for b in mine:
            _place(b, cx, y_rc)
            cx += b.w + RC_GAP
        socket_boxes.append((name, x, x + wide))
        x += wide + SOCKET_GAP
    for k, (name, x0, x1) in enumerate(socket_boxes):
        out += [
            _rect(x0, top, x1 - x0, SOCKET_H, GREY[0], GREY[1], 1.5),
            _text((x0 + x1) / 2, top + 19, name, 12.5, "#202124", "bold", "middle"),
            _text((x0 + x1) / 2, top + 34, "host memory \u00b7 PCIe host bridges", 10, "#5f6368", anchor="middle"),
        ]
        if k:
            prev = socket_boxes[k - 1][2]
            out += [
                f'<line x1="{prev}" y1="{top + SOCKET_H / 2}" x2="{x0}" y2="{top + SOCKET_H / 2}" '
                f'stroke="{GREY[1]}" stroke-width="3"/>',
                _text((prev + x0) / 2, top + SOCKET_H / 2 - 6, "UPI/QPI", 9.5, "#5f6368", anchor="middle"),
            ]
    for b in rcs:
        cx = b.x + b.w / 2
        out += [
            f'<line x1="{cx:.1f}" y1="{top + SOCKET_H}" x2="{cx:.1f}" y2="{b.y}" stroke="{b.colours[1]}" '
            f'stroke-width="3"/>',
            _text(cx + 6, b.y - SOCKET_WIRE / 2 + 4, b.up, 10, "#3c4043"),
        ]
    return out, x - SOCKET_GAP + MARGIN


def _gpu_boxes(boxes: list[_Box]) -> dict[int, _Box]:
    found = {}
    for b in boxes:
        found.update({b.gpu: b} if b.kind == "gpu" else _gpu_boxes(b.children))
    return found


def _nvlinks(t: Topology, gpus: dict[int, _Box], y0: float) -> tuple[list[str], float]:
    """Each NVLink as a thick U below its two GPUs, in the first lane where it overlaps no other; returns the bottom."""
    out, lanes, used = [], [], {i: 0 for i in gpus}
    for link in sorted(t.nvlinks, key=lambda x: abs(gpus[x.a].x - gpus[x.b].x)):
        xs = []
        for i in (link.a, link.b):
            xs.append(gpus[i].x + gpus[i].w / 2 + 14 * used[i] * (-1) ** used[i])
            used[i] += 1
        lo, hi = sorted(xs)
        lane = next((k for k, spans in enumerate(lanes) if all(hi + 40 < a or lo - 40 > b for a, b in spans)), None)
        if lane is None:
            lane, lanes = len(lanes), lanes + [[]]
        lanes[lane].append((lo, hi))
        y = y0 + LANE_H * lane
        ya, yb = (gpus[i].y + gpus[i].h for i in (link.a, link.b))
        out += [
            f'<path d="M{xs[0]:.1f},{ya:.1f} V{y:.1f} H{xs[1]:.1f} V{yb:.1f}" fill="none" stroke="{NVLINK}" '
            f'stroke-width="6" stroke-linejoin="round" stroke-linecap="round"/>',
            _text((lo + hi) / 2, y + 16, f"NV{link.links} {link.gbps:.0f} GB/s", 11, "#3b6e00", "bold", "middle"),
        ]
    return out, y0 + LANE_H * len(lanes) + (8 if lanes else -12)


def _footer(t: Topology, rcs: list[_Box], y: float) -> tuple[list[str], float]:
    """One row per run of GPUs with equal figures: a bar alone (light) over a bar with the group copying (solid)."""
    out = [
        _text(
            MARGIN,
            y + 4,
            "host \u2192 GPU bandwidth: alone (light bar) vs its whole contention group copying at once (solid bar)",
            12,
            "#202124",
            "bold",
        )
    ]
    scale = BAR_W / max(loads_gbps(t, i)[0] for i in range(t.num_gpus))
    colour = {rc.name: b.colours for rc, b in zip(t.root_complexes, rcs)}
    y += 14
    for group in t.contention_groups():
        runs: list[list[int]] = []
        for i in group:
            same = runs and loads_gbps(t, runs[-1][-1]) == loads_gbps(t, i)
            runs[-1].append(i) if same else runs.append([i])
        for run in runs:
            alone, grouped = loads_gbps(t, run[0])
            light, strong = colour[t.gpus[run[0]].root_complex]
            who = f"{'GPU' if len(run) == 1 else 'GPUs'} {ranges(run)} ({t.gpus[run[0]].root_complex})"
            every = "both" if len(group) == 2 else f"all {len(group)}"
            busy = f"{_gbps(grouped)} while {every} copy" if len(group) > 1 else "no other GPU shares its uplink"
            out += [
                _rect(MARGIN, y + 3, 12, 12, strong, strong, 1, 2),
                _text(MARGIN + 18, y + 13, who, 11),
                _rect(MARGIN + 150, y + 2, alone * scale, 7, light, strong, 0.8, 1),
                _rect(MARGIN + 150, y + 10, grouped * scale, 7, strong, strong, 0.8, 1),
                _text(MARGIN + 160 + BAR_W, y + 13, f"{_gbps(alone)} alone, {busy}", 11),
            ]
            y += ROW_H
    return out, y


def _legend(t: Topology, y: float) -> list[str]:
    nvlink = "; thick green: NVLink" if t.nvlinks else ""
    return [
        _text(
            MARGIN, y + 8, "Colour = contention group: the GPUs under one root complex share its uplink.", 10, "#5f6368"
        ),
        _text(
            MARGIN,
            y + 22,
            f"Lines: PCIe links labelled with their bandwidth (GB/s, one direction){nvlink}.",
            10,
            "#5f6368",
        ),
    ]


def svg_text(t: Topology, title: str | None = None) -> str:
    """The picture as an SVG document (a string)."""
    rcs = _rc_boxes(t)
    for b in rcs:
        _measure(b)
    body, width = _sockets(t, rcs, TOP)
    body += [line for b in rcs for line in _draw(b)]
    links, y = _nvlinks(t, _gpu_boxes(rcs), max(b.y + b.h for b in rcs) + 22)
    footer, y = _footer(t, rcs, y + 24)
    body += links + footer + _legend(t, y + 4)
    width = max(width, 780.0)
    height = y + 42
    head = [
        _text(MARGIN, 30, title or f"topology {t.name}", 17, "#202124", "bold"),
        _text(
            MARGIN,
            50,
            f"{t.source} \u00b7 "
            + " \u00b7 ".join(summary(t))
            + f" \u00b7 host memory {memory_text(t.host_memory_bytes)}",
            11.5,
            "#5f6368",
        ),
    ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}">\n'
        f'<rect width="100%" height="100%" fill="#ffffff"/>\n' + "\n".join(head + body) + "\n</svg>\n"
    )


def svg_topology(t: Topology, path: str | Path, title: str | None = None) -> Path:
    """Write the picture of `t` to `path` (an .svg file); TopologyError when it cannot be written."""
    path = Path(path)
    try:
        path.write_text(svg_text(t, title), encoding="utf-8")
    except OSError as e:
        raise TopologyError(f"{path}: cannot write the topology picture: {e}") from e
    return path
