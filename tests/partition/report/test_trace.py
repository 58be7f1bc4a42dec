"""Pictures of a simulated step: the ASCII timeline's rows and characters, the SVG's well-formedness, the PNG."""

import ast
import colorsys
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import partition.report.trace
from partition.report.trace import RenderError, ascii_timeline, chrome_trace, fill_hsl, lanes, svg_timeline
from partition.report.trace_png import png_timeline
from partition.sim.simulate import SimResult, SimStage, simulate

SVG = "{http://www.w3.org/2000/svg}"


def hand_result() -> SimResult:
    """gpu 0: F of stage 0 in [0, 0.5), B in [0.5, 1.0); gpu 1 idle; one load, one offload, one update."""
    events = (
        ("load", 0, 0, -1, 0.0, 0.2),
        ("F", 0, 0, 0, 0.0, 0.5),
        ("B", 0, 0, 0, 0.5, 1.0),
        ("offload", 0, 0, -1, 0.7, 0.9),
        ("update", 0, 0, -1, 0.9, 1.0),
    )
    return SimResult(step_time_s=1.0, compute_busy_s=(1.0, 0.0), events=events)


def four_stage_result() -> SimResult:
    stages = [
        SimStage(
            gpu=j % 2, fwd_s=0.01 * (j + 1), bwd_s=0.02, load_s=0.005, offload_s=0.005, update_s=0.003, comm_s=0.001
        )
        for j in range(4)
    ]
    return simulate(stages, num_gpus=2, microbatches=3)


def rows_of(text: str) -> dict[str, str]:
    """Row label -> its cells, for the lanes of an ascii timeline."""
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(("gpu ", "host "))]
    return {label.strip(): cells for label, cells in lines}


def test_hand_timeline_characters():
    rows = rows_of(ascii_timeline(hand_result(), num_gpus=2, width=10))
    assert rows["gpu 0 compute"] == "aaaaaAAAAA"
    assert rows["gpu 1 compute"] == "." * 10
    assert rows["gpu 0 copy"] == "LL.....OO."
    assert rows["host update"] == "." * 9 + "U"


def test_one_compute_and_one_copy_row_per_gpu():
    text = ascii_timeline(four_stage_result(), num_gpus=2, width=60)
    lines = text.splitlines()
    for g in range(2):
        assert sum(line.startswith(f"gpu {g} compute") for line in lines) == 1
        assert sum(line.startswith(f"gpu {g} copy") for line in lines) == 1
    rows = rows_of(text)
    assert all(len(cells) == 60 for cells in rows.values())
    assert set(rows["gpu 0 compute"]) <= set("acAC.") and set(rows["gpu 1 compute"]) <= set("bdBD.")
    assert "legend" in text and "|" in text  # the time axis and the legend


def test_width_too_small_is_refused():
    with pytest.raises(ValueError, match="at least 10"):
        ascii_timeline(hand_result(), 2, width=5)


def test_lanes_hold_every_event_once():
    result = four_stage_result()
    drawn = [e for _, events in lanes(result, 2) for e in events]
    assert sorted(drawn) == sorted(result.events)


def test_svg_is_well_formed_with_a_rect_per_event(tmp_path: Path):
    result = four_stage_result()
    path = svg_timeline(result, 2, tmp_path / "step.svg", title="four stages <on> two gpus")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    rects = root.findall(f"{SVG}rect")
    assert len(rects) >= len(result.events)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "four stages <on> two gpus" in texts and "time (ms)" in texts
    assert all(float(r.get("width") or 0) > 0 for r in rects)


def test_svg_of_an_empty_step(tmp_path: Path):
    empty = SimResult(step_time_s=0.0, compute_busy_s=(0.0,), events=())
    root = ET.parse(svg_timeline(empty, 1, tmp_path / "empty.svg")).getroot()
    assert root.findall(f"{SVG}rect")


def test_svg_axis_in_seconds_for_long_steps(tmp_path: Path):
    long = SimResult(step_time_s=197.0, compute_busy_s=(1.0,), events=(("F", 0, 0, 0, 0.0, 150.0),))
    texts = [t.text for t in ET.parse(svg_timeline(long, 1, tmp_path / "long.svg")).getroot().iter(f"{SVG}text")]
    assert "time (s)" in texts and "100" in texts and "time (ms)" not in texts


def test_chrome_trace_has_a_process_per_gpu_and_the_host(tmp_path: Path):
    result = SimResult(
        step_time_s=1.0, compute_busy_s=(1.0, 0.0), events=hand_result().events, stage_bytes=((4_000_000, 8_000_000),)
    )
    doc = json.loads(chrome_trace(result, tmp_path / "t.json").read_text())
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "gpu 0"), (1, "gpu 1"), (2, "host")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(0, 0)] == "compute" and "load" in threads[(0, 1)] and "offload" in threads[(0, 2)]
    assert threads[(2, 0)] == "Adam (update)"
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert len(spans) == len(result.events)
    f, load, off, upd = spans["F0.0"], spans["load 0"], spans["offload 0"], spans["update 0"]
    assert (f["pid"], f["tid"], f["ts"], f["dur"]) == (0, 0, 0.0, 0.5e6)  # microseconds
    assert (load["tid"], off["tid"], upd["pid"]) == (1, 2, 2)
    assert load["args"] == {"stage": 0, "bytes": 4_000_000, "average GB/s": 0.02}  # 4 MB in 0.2 s
    assert off["args"]["bytes"] == 8_000_000 and f["args"] == {"stage": 0, "microbatch": 0}
    assert doc["otherData"]["step_time_s"] == 1.0


def test_chrome_trace_of_a_simulated_step(tmp_path: Path):
    result = four_stage_result()
    doc = json.loads(chrome_trace(result, tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(result.events)
    assert {e["pid"] for e in xs} == {0, 1, 2} and all(e["dur"] >= 0 for e in xs)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(result.step_time_s * 1e6)


def test_png_timeline_is_drawn_without_any_program_on_path(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: matplotlib draws it in-process
    path = png_timeline(four_stage_result(), 2, tmp_path / "step.png", title="four stages")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.shape[1] == 1200 and pixels.shape[0] > 200  # 12 x (1.6 + 0.3 per lane) inches at 100 dpi
    colours = {tuple(round(float(c) * 255) for c in px[:3]) for px in pixels.reshape(-1, pixels.shape[2])}
    for kind, j in (("F", 0), ("B", 1), ("load", 2), ("update", 3)):  # a block of each kind is drawn
        h, sat, light = fill_hsl(kind, j)
        want = tuple(round(c * 255) for c in colorsys.hls_to_rgb(h / 360, light / 100, sat / 100))
        assert any(max(abs(a - b) for a, b in zip(want, c)) <= 2 for c in colours), (kind, want)


def test_png_without_matplotlib_says_use_svg(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if it were not installed
    with pytest.raises(RenderError, match=r"matplotlib, which is not installed.*scripts/setup.sh.*--svg"):
        png_timeline(four_stage_result(), 2, tmp_path / "step.png")
    assert not (tmp_path / "step.png").exists()


def test_trace_imports_neither_torch_nor_mobiuspipe():
    tree = ast.parse(Path(partition.report.trace.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.split(".")[0] in ("torch", "mobiuspipe")}
