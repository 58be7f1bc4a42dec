"""Pictures of one simulated step: an ASCII timeline, an SVG Gantt chart (PNG: trace_png.py) and a Chrome trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from xml.sax.saxutils import escape

from partition.sim.simulate import SimResult

__all__ = ["ascii_timeline", "svg_timeline", "chrome_trace", "lanes", "fill_hsl", "RenderError"]


class RenderError(RuntimeError):
    """A picture could not be made (its drawing library is missing or failed); the message says what to do."""


Event = tuple[str, int, int, int, float, float]
"""(kind, gpu, stage, microbatch or -1, start, end), as in SimResult.events."""

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_COPY_CHARS = {"load": "L", "offload": "O", "update": "U"}
_LEGEND = (
    "legend: a-z forward of stage j (a=0, b=1, ..., z=25, then wraps), A-Z its backward (recompute + backward), . idle",
    "        L load weights host->gpu, O offload gradients gpu->host, U optimizer update on the host CPU",
)


def lanes(result: SimResult, num_gpus: int) -> list[tuple[str, list[Event]]]:
    """Rows of the picture: per gpu its compute stream and its copy engines, then the host's updates."""
    rows: list[tuple[str, list[Event]]] = []
    for g in range(num_gpus):
        rows.append((f"gpu {g} compute", [e for e in result.events if e[1] == g and e[0] in ("F", "B")]))
        rows.append((f"gpu {g} copy", [e for e in result.events if e[1] == g and e[0] in ("load", "offload")]))
    rows.append(("host update", [e for e in result.events if e[0] == "update"]))
    return rows


def _char(kind: str, stage: int) -> str:
    if kind in _COPY_CHARS:
        return _COPY_CHARS[kind]
    letter = _LETTERS[stage % len(_LETTERS)]
    return letter if kind == "F" else letter.upper()


def _ascii_row(events: list[Event], span: float, width: int) -> str:
    """One character per span/width seconds: what ran longest during that cell, '.' if nothing ran."""
    dt = span / width
    best = [dt * 1e-9] * width  # overlaps below this are rounding at a cell edge, not work
    cells = ["."] * width
    for kind, _, j, _, start, end in events:
        for c in range(min(int(start / dt), width - 1), min(int(end / dt), width - 1) + 1):
            overlap = min(end, (c + 1) * dt) - max(start, c * dt)
            if overlap > best[c]:
                best[c], cells[c] = overlap, _char(kind, j)
    return "".join(cells)


def _fmt_time(t: float, unit: str) -> str:
    return f"{t:.3g} s" if unit == "s" else f"{t * 1e3:.3g} ms"


def _ascii_axis(span: float, width: int, indent: int) -> list[str]:
    """A ruler with a tick every 10 columns and the time of each tick that has room for its label."""
    ruler = "".join("|" if c % 10 == 0 else "-" for c in range(width)) + "|"
    unit = "s" if span >= 1.0 else "ms"
    labels = [" "] * (width + 12)
    free = 0
    for c in range(0, width + 1, 10):
        text = _fmt_time(span * c / width, unit)
        if c >= free and c + len(text) <= len(labels):
            labels[c : c + len(text)] = text
            free = c + len(text) + 1
    return [" " * indent + ruler, " " * indent + "".join(labels).rstrip()]


def ascii_timeline(result: SimResult, num_gpus: int, width: int = 100) -> str:
    """A terminal picture of one step: two rows per gpu (compute, copy), one for the host, a time axis, a legend."""
    if width < 10:
        raise ValueError(f"timeline width must be at least 10 columns, found {width}")
    span = result.step_time_s if result.step_time_s > 0 else 1.0
    rows = lanes(result, num_gpus)
    indent = max(len(label) for label, _ in rows) + 2
    lines = [f"{label:<{indent}}{_ascii_row(events, span, width)}" for label, events in rows]
    lines += _ascii_axis(span, width, indent)
    unit = "s" if span >= 1.0 else "ms"
    lines += [*_LEGEND, f"        one column = {_fmt_time(span / width, unit)}, showing what ran longest during it"]
    return "\n".join(lines) + "\n"


# ---- SVG ----

_LEFT, _RIGHT, _TOP, _LANE, _GAP, _PLOT_W = 120, 30, 50, 16, 4, 1000


def fill_hsl(kind: str, stage: int) -> tuple[int, int, int]:
    """(hue in degrees, saturation %, lightness %) of an event: stage colours spread by the golden angle; forward
    light, backward dark, loads in between; offloads and updates grey."""
    light = {"F": 80, "B": 42, "load": 62}.get(kind)
    if light is None:
        return (0, 0, 55 if kind == "offload" else 30)
    return (round(stage * 137.508 % 360), 65, light)


def _fill(kind: str, stage: int) -> str:
    if kind not in ("F", "B", "load"):
        return "#8c8c8c" if kind == "offload" else "#4d4d4d"
    h, s, l = fill_hsl(kind, stage)
    return f"hsl({h},{s}%,{l}%)"


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str = "") -> str:
    title = f"<title>{escape(tip)}</title>" if tip else ""
    return f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.4):.2f}" height="{h:.2f}" fill="{fill}">{title}</rect>'


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 11) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">{escape(s)}</text>'


def _svg_backgrounds(rows: list[tuple[str, list[Event]]]) -> list[str]:
    out = []
    for r, (label, _) in enumerate(rows):
        y = _TOP + r * (_LANE + _GAP)
        out += [_rect(_LEFT, y, _PLOT_W, _LANE, "#f4f4f4"), _text(_LEFT - 6, y + _LANE - 4, label, "end")]
    return out


def _svg_events(rows: list[tuple[str, list[Event]]], span: float) -> list[str]:
    out = []
    for r, (_, events) in enumerate(rows):
        y = _TOP + r * (_LANE + _GAP)
        for kind, g, j, i, start, end in events:
            x = _LEFT + _PLOT_W * start / span
            tip = (
                f"{kind} stage {j}"
                + (f" microbatch {i}" if i >= 0 else "")
                + f" on gpu {g}: {start * 1e3:.3f}-{end * 1e3:.3f} ms"
            )
            out.append(_rect(x, y, _PLOT_W * (end - start) / span, _LANE, _fill(kind, j), tip))
    return out


def _tick_step_ms(span_ms: float) -> float:
    """A 1/2/5 x 10^k step that gives at most about 10 ticks (of whatever unit span_ms is in)."""
    raw = span_ms / 10
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _svg_axis(span: float, y: float) -> list[str]:
    """Ticks in milliseconds, or in seconds for a step of 10 s or more."""
    unit, scale = ("s", 1.0) if span >= 10 else ("ms", 1e3)
    span_u, out = span * scale, []
    step = _tick_step_ms(span_u)
    for k in range(int(span_u / step + 1e-9) + 1):
        x = _LEFT + _PLOT_W * k * step / span_u
        out.append(f'<line x1="{x:.2f}" y1="{_TOP - 4}" x2="{x:.2f}" y2="{y}" stroke="#bbb" stroke-width="0.5"/>')
        out.append(_text(x, y + 14, f"{k * step:g}", "middle", 10))
    out.append(_text(_LEFT + _PLOT_W / 2, y + 30, f"time ({unit})", "middle"))
    return out


def _svg_legend(y: float) -> list[str]:
    items = [
        ("F", "forward (lighter)"),
        ("B", "backward (darker)"),
        ("load", "load weights"),
        ("offload", "offload gradients"),
        ("update", "optimizer update (host)"),
    ]
    out, x = [], _LEFT
    for kind, label in items:
        out += [_rect(x, y, 14, 12, _fill(kind, 0)), _text(x + 18, y + 10, label)]
        x += 36 + 7 * len(label)
    out.append(_text(_LEFT, y + 30, "colour = stage (hover a block for its stage, microbatch and times)"))
    return out


def svg_timeline(result: SimResult, num_gpus: int, path: str | Path, title: str = "") -> Path:
    """Write a Gantt chart of one step to `path` (SVG, no external resources); returns the path."""
    span = result.step_time_s if result.step_time_s > 0 else 1.0
    rows = lanes(result, num_gpus)
    bottom = _TOP + len(rows) * (_LANE + _GAP)
    width, height = _LEFT + _PLOT_W + _RIGHT, bottom + 90
    head = title or f"one step: {span * 1e3:.1f} ms"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f"<title>{escape(head)}</title>",
        _text(_LEFT, 24, head, size=15),
        *_svg_backgrounds(rows),
        *_svg_axis(span, bottom),
        *_svg_events(rows, span),
        *_svg_legend(bottom + 44),
        "</svg>",
    ]
    path = Path(path)
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n' + "\n".join(parts) + "\n", encoding="utf-8")
    return path


# ---- Chrome trace ----

_TIDS = {
    "F": (0, "compute"),
    "B": (0, "compute"),
    "load": (1, "copy host->gpu (load)"),
    "offload": (2, "copy gpu->host (offload)"),
    "update": (0, "Adam (update)"),
}


def _trace_name(kind: str, j: int, i: int) -> str:
    return f"{kind}{j}.{i}" if kind in ("F", "B") else f"{kind} {j}"


def _trace_args(result: SimResult, kind: str, j: int, i: int, start: float, end: float) -> dict:
    args: dict = {"stage": j} | ({"microbatch": i} if i >= 0 else {})
    if kind in ("load", "offload") and j < len(result.stage_bytes):
        nbytes = result.stage_bytes[j][0 if kind == "load" else 1]
        args["bytes"] = nbytes
        if end > start and nbytes:
            args["average GB/s"] = round(nbytes / (end - start) / 1e9, 3)
    return args


def _trace_meta(num_gpus: int) -> list[dict]:
    meta = []
    for pid in range(num_gpus + 1):
        name = f"gpu {pid}" if pid < num_gpus else "host"
        meta += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
        kinds = ("F", "load", "offload") if pid < num_gpus else ("update",)
        meta += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": _TIDS[k][0], "args": {"name": _TIDS[k][1]}}
            for k in kinds
        ]
    return meta


def chrome_trace(result: SimResult, path: str | Path) -> Path:
    """Write the step as Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per gpu with
    compute / load / offload threads, and one for the host's Adam; times in microseconds."""
    n = len(result.compute_busy_s)
    events = [
        {
            "name": _trace_name(kind, j, i),
            "cat": kind,
            "ph": "X",
            "ts": start * 1e6,
            "dur": (end - start) * 1e6,
            "pid": n if kind == "update" else g,
            "tid": _TIDS[kind][0],
            "args": _trace_args(result, kind, j, i, start, end),
        }
        for kind, g, j, i, start, end in result.events
    ]
    doc = {
        "traceEvents": _trace_meta(n) + events,
        "displayTimeUnit": "ms",
        "otherData": {"step_time_s": result.step_time_s, "link_model": result.link_model},
    }
    path = Path(path)
    path.write_text(json.dumps(doc) + "\n", encoding="utf-8")
    return path
