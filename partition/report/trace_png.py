"""The Gantt chart of one simulated step as a PNG, drawn with matplotlib (a pinned dependency: no external program)."""

from __future__ import annotations

import colorsys
from pathlib import Path

from partition.report.trace import RenderError, fill_hsl, lanes
from partition.sim.simulate import SimResult

__all__ = ["png_timeline"]

_LEGEND = (("F", "forward (lighter)"), ("B", "backward (darker)"), ("load", "load weights"))
_GREYS = (("offload", "offload gradients"), ("update", "optimizer update (host)"))


def _rgb(kind: str, stage: int) -> tuple[float, float, float]:
    h, s, l = fill_hsl(kind, stage)
    return colorsys.hls_to_rgb(h / 360, l / 100, s / 100)


def png_timeline(result: SimResult, num_gpus: int, path: str | Path, title: str = "") -> Path:
    """Write the step's Gantt chart to `path` as PNG: the lanes of the SVG (per gpu compute and copy, then the
    host's updates), colour = stage; returns the path. RenderError when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RenderError(
            f"cannot write {path}: the PNG is drawn with matplotlib, which is not installed ({e}); run "
            f"scripts/setup.sh (it installs the pinned version), or write an SVG instead (--svg)"
        ) from e
    span = result.step_time_s if result.step_time_s > 0 else 1.0
    unit, scale = ("s", 1.0) if span >= 10 else ("ms", 1e3)
    rows = lanes(result, num_gpus)
    fig = Figure(figsize=(12, 1.6 + 0.3 * len(rows)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for r, (_, events) in enumerate(rows):
        ax.broken_barh(
            [(start * scale, max(end - start, 0.0) * scale) for _, _, _, _, start, end in events],
            (r - 0.4, 0.8),
            facecolors=[_rgb(kind, j) for kind, _, j, _, _, _ in events],
        )
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # gpu 0 on top, the host at the bottom, as in the SVG
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"one step: {span * 1e3:.1f} ms", loc="left")
    fig.legend(
        handles=[Patch(color=_rgb(kind, 0), label=label) for kind, label in (*_LEGEND, *_GREYS)],
        loc="outside lower center",
        ncol=5,
        frameon=False,
    )
    path = Path(path)
    fig.savefig(path, format="png", facecolor="white")
    return path
