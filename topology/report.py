"""Reports of a Topology: the `topology --json` document, an lstopo-style tree and an nvidia-smi style matrix."""

from __future__ import annotations

from foundation.units import fmt_bytes
from topology.types import Topology

__all__ = [
    "to_json_dict",
    "render_tree",
    "render_matrix",
    "render_text",
    "group_sizes",
    "loads_gbps",
    "memory_text",
    "link_text",
    "level_matrix",
    "summary",
    "ranges",
    "LEGEND",
    "P2P_LEGEND",
]

LEGEND = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("NV#", "Connection traversing a bonded set of # NVLinks"),
)
"""The `nvidia-smi topo -m` legend of current drivers, word for word."""

P2P_LEGEND = (
    ("X", "Self"),
    ("OK", "Status Ok"),
    ("CNS", "Chipset not supported"),
    ("GNS", "GPU not supported"),
    ("TNS", "Topology not supported"),
    ("NS", "Not supported"),
    ("DR", "Disabled by regkey"),
    ("U", "Unknown"),
)
"""The `nvidia-smi topo -p2p r` legend."""


def group_sizes(t: Topology) -> dict[int, int]:
    """gpu index -> number of GPUs sharing its root complex uplink (itself included)."""
    return {i: len(group) for group in t.contention_groups() for i in group}


def loads_gbps(t: Topology, gpu: int) -> tuple[float, float]:
    """Host->GPU GB/s of `gpu` copying alone, and while its whole contention group copies at once."""
    return t.load_gbps(gpu, 1), t.load_gbps(gpu, group_sizes(t)[gpu])


def level_matrix(t: Topology) -> list[list[str]]:
    """t.level(a, b) for every gpu pair: the cells of `nvidia-smi topo -m`."""
    return [[t.level(a, b) for b in range(t.num_gpus)] for a in range(t.num_gpus)]


def to_json_dict(t: Topology) -> dict:
    """The `topology --json` document: the docs/design.md contract (gpus, contention_groups, source), everything of
    `t.to_dict()`, per gpu `load_gbps_alone` / `load_gbps_group` (GB/s) and the level `matrix`."""
    d = t.to_dict()
    for g in d["gpus"]:
        g["load_gbps_alone"], g["load_gbps_group"] = loads_gbps(t, g["index"])
    head = {
        "name": d.pop("name"),
        "source": d.pop("source"),
        "gpus": d.pop("gpus"),
        "contention_groups": t.contention_groups(),
    }
    return {**head, **d, "matrix": level_matrix(t)}


def memory_text(n: int) -> str:
    """A memory size with one decimal ("24.0 GiB"); "unknown" for 0, what a topology says when it does not know."""
    return fmt_bytes(n, digits=1) if n > 0 else "unknown"


def link_text(gen: int, width: int, gbps: float) -> str:
    """ "gen4 x16 31.51 GB/s" (PCIe generation and lanes), or "link 10.00 GB/s" when both are unknown."""
    pcie = f"gen{gen} x{width}" if gen and width else (f"gen{gen}" if gen else "link")
    return f"{pcie} {gbps:.2f} GB/s"


def _plural(n: int, word: str, words: str) -> str:
    return f"{n} {word if n == 1 else words}"


def summary(t: Topology) -> list[str]:
    """The counts a reader wants first: ["4 GPUs", "2 root complexes", ..., "no GPU peer-to-peer"]."""
    parts = [_plural(t.num_gpus, "GPU", "GPUs"), _plural(len(t.root_complexes), "root complex", "root complexes")]
    if t.switches:
        parts.append(_plural(len(t.switches), "PCIe switch", "PCIe switches"))
    if t.nvme:
        parts.append(_plural(len(t.nvme), "NVMe drive", "NVMe drives"))
    pairs = sum(t.p2p_ok(a, b) for a in range(t.num_gpus) for b in range(a + 1, t.num_gpus))
    parts.append(f"GPU peer-to-peer on {_plural(pairs, 'pair', 'pairs')}" if pairs else "no GPU peer-to-peer")
    return parts


def _gpu_cells(t: Topology, i: int) -> list[str]:
    g, size = t.gpus[i], group_sizes(t)[i]
    alone, grouped = loads_gbps(t, i)
    load = f"h2d {alone:.2f} GB/s alone" + (f", {grouped:.2f} with {size} copying" if size > 1 else "")
    return [g.name, memory_text(g.memory_bytes), g.pci_bus_id, link_text(g.pcie_gen, g.pcie_width, g.link_gbps), load]


def _gpu_lines(t: Topology) -> dict[int, str]:
    """gpu index -> its tree line, indented by depth, columns aligned across all GPUs."""
    labels = {i: "  " * (2 + len(t.switch_chain(i))) + f"gpu {i}" for i in range(t.num_gpus)}
    cells = {i: [labels[i], *_gpu_cells(t, i)] for i in range(t.num_gpus)}
    widths = [max(len(c[k]) for c in cells.values()) for k in range(len(cells[0]) - 1)]
    return {i: "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for i, row in cells.items()}


def _attached(t: Topology, rc: str, switch: str) -> tuple[list, list[int], list]:
    """Child switches, gpu indices and NVMe drives right below `switch` ("" = the root complex's own ports)."""
    switches = [s for s in t.switches if s.root_complex == rc and s.parent == switch]
    gpus = [g.index for g in t.gpus if g.root_complex == rc and g.switch == switch]
    nvme = [d for d in t.nvme if d.root_complex == rc and d.switch == switch]
    return switches, gpus, nvme


def _subtree(t: Topology, rc: str, switch: str, depth: int, gpu_lines: dict[int, str]) -> list[str]:
    switches, gpus, nvme = _attached(t, rc, switch)
    pad = "  " * depth
    lines = [gpu_lines[i] for i in gpus]
    for d in nvme:
        model = f"  {d.model}" if d.model else ""
        lines.append(f"{pad}{d.name}{model}  {d.pci_bus_id}  NVMe  {d.link_gbps:.2f} GB/s")
    for s in switches:
        lines.append(f"{pad}{s.name}  PCIe switch  uplink {s.uplink_gbps:.2f} GB/s")
        lines += _subtree(t, rc, s.name, depth + 1, gpu_lines)
    return lines


def _sockets(t: Topology) -> list[int]:
    """NUMA nodes of the root complexes, in order of first appearance."""
    return list(dict.fromkeys(r.numa_node for r in t.root_complexes))


def _pcie_tree(t: Topology) -> list[str]:
    gpu_lines, lines = _gpu_lines(t), []
    for numa in _sockets(t):
        lines.append(f"socket {numa} (NUMA node {numa})" if numa >= 0 else "socket ? (NUMA node unknown)")
        for rc in (r for r in t.root_complexes if r.numa_node == numa):
            members = [g.index for g in t.gpus if g.root_complex == rc.name]
            shared = f"  shared by {'gpu' if len(members) == 1 else 'gpus'} {ranges(members)}" if members else ""
            lines.append(f"  {rc.name}  root complex  uplink {rc.uplink_gbps:.2f} GB/s{shared}")
            lines += _subtree(t, rc.name, "", 2, gpu_lines) or ["    (nothing attached)"]
    return lines


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _measured(t: Topology) -> list[str]:
    """The probe's figures as a small table, GB/s, one column per gpu ("-" = not measured)."""
    m = t.measured
    if m is None:
        return []
    row = lambda label, v: f"  {label:<30}" + "".join(f"{x:>7.2f}" if x else "      -" for x in v)  # noqa: E731
    lines = ["measured (--probe):"]
    if m.h2d_gbps or m.h2d_group_gbps or m.d2d_gbps:
        lines.append(f"  {'GB/s':<30}" + "".join(f"{f'gpu{i}':>7}" for i in range(t.num_gpus)))
    if m.h2d_gbps:
        lines.append(row("host->gpu, alone", m.h2d_gbps))
    if m.h2d_group_gbps:
        lines.append(row("host->gpu, whole group copying", m.h2d_group_gbps))
    for a, d2d in enumerate(m.d2d_gbps):
        lines.append(row(f"gpu{a}->", d2d))
    if m.matmul_tflops:
        lines.append(row("bf16 matmul, TFLOPS", m.matmul_tflops))
    if m.matmul_fp32_tflops:
        lines.append(row("fp32 matmul, TFLOPS", m.matmul_fp32_tflops))
    if m.ssd_dir:
        lines.append(f"  ssd {m.ssd_dir}: read {m.ssd_read_gbps:.2f} GB/s, write {m.ssd_write_gbps:.2f} GB/s")
    if m.host_adam_params_per_s:
        lines.append(f"  host Adam: {m.host_adam_params_per_s / 1e9:.2f}e9 params/s a rank, every rank at once")
    if m.host_cores:
        lines.append(f"  host cores: {m.host_cores:.2f} (computations at once, in units of one alone)")
    if m.message_latency_s:
        ms = m.message_latency_s * 1e3
        lines.append(f"  messages between ranks: {ms:.3f} ms + bytes at {m.message_gbps:.2f} GB/s")
    if m.message_send_s:
        lines.append(f"  posting a message: {m.message_send_s * 1e3:.3f} ms of the sender's thread")
    if m.message_recv_s:
        lines.append(f"  receiving a message: {m.message_recv_s * 1e3:.3f} ms of the receiver's thread")
    if m.step_overhead_s:
        lines.append(f"  the training loop between steps: {m.step_overhead_s * 1e3:.3f} ms a step")
    return lines + [f"  note: {n}" for n in m.notes]


def render_tree(t: Topology) -> str:
    """lstopo-like: socket -> root complex -> switch -> GPU / NVMe, then NVLinks, groups, memory, probe, notes."""
    lines = [f"topology {t.name} ({t.source}): " + ", ".join(summary(t)), *_pcie_tree(t)]
    lines += [f"NVLink: gpu {x.a} <-> gpu {x.b}  NV{x.links}  {x.gbps:.2f} GB/s" for x in t.nvlinks]
    lines.append(
        "contention groups: "
        + " ".join(str(g) for g in t.contention_groups())
        + "  (gpus that share a root complex uplink)"
    )
    lines.append(f"host memory: {memory_text(t.host_memory_bytes)}")
    lines += _measured(t)
    if t.notes:
        lines += ["notes:", *(f"  - {n}" for n in t.notes)]
    return "\n".join(lines) + "\n"


def _grid(names: list[str], rows: list[list[str]], extra: list[str], extra_rows: list[list[str]]) -> list[str]:
    """A `nvidia-smi topo` grid: 8-wide cells, " X " on the diagonal, then the wider extra columns."""
    cell = lambda c: f" {c:<7}" if c == "X" else f"{c:<8}"  # noqa: E731
    widths = [max(len(h), *(len(r[k]) for r in extra_rows)) + 4 for k, h in enumerate(extra)] if extra else []
    head = " " * 8 + "".join(f"{n:<8}" for n in names) + "".join(h.ljust(w) for h, w in zip(extra, widths))
    body = [
        f"{names[a]:<8}"
        + "".join(cell(c) for c in row)
        + "".join(x.ljust(w) for x, w in zip(extra_rows[a] if extra else [], widths))
        for a, row in enumerate(rows)
    ]
    return [line.rstrip() for line in [head, *body]]


def _legend(items: tuple[tuple[str, str], ...]) -> list[str]:
    return ["Legend:", "", *(f"  {k:<4} = {v}" for k, v in items)]


def render_matrix(t: Topology) -> str:
    """nvidia-smi `topo -m` style: the level of every gpu pair, CPU and NUMA affinity, the legend; then the
    P2P status matrix and its legend when t.p2p is known."""
    names = [f"GPU{i}" for i in range(t.num_gpus)]
    affinity = [[g.cpu_affinity or "N/A", str(g.numa_node) if g.numa_node >= 0 else "N/A"] for g in t.gpus]
    lines = _grid(names, level_matrix(t), ["CPU Affinity", "NUMA Affinity"], affinity) + [""] + _legend(LEGEND)
    if t.p2p:
        lines += ["", "P2P read status (nvidia-smi topo -p2p r):"]
        lines += _grid(names, [list(r) for r in t.p2p], [], []) + [""] + _legend(P2P_LEGEND)
    return "\n".join(lines) + "\n"


def render_text(t: Topology) -> str:
    """What `mobiuspipe topology` prints: the tree, a blank line, the matrix."""
    return render_tree(t) + "\n" + render_matrix(t)
