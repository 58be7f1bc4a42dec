"""Reports of a Topology: the `topology --json` document and a readable text summary."""

from __future__ import annotations

from dataclasses import asdict

from topology.types import Topology

__all__ = ["to_json_dict", "render_text"]


def _group_sizes(t: Topology) -> dict[int, int]:
    """gpu index -> number of GPUs sharing its root complex uplink (itself included)."""
    return {i: len(group) for group in t.contention_groups() for i in group}


def to_json_dict(t: Topology) -> dict:
    """The `topology --json` document (DESIGN.md contract: gpus, contention_groups, source, and more).

    Each gpu carries `load_gbps`: its host->GPU bandwidth while its whole contention group copies at once.
    """
    sizes = _group_sizes(t)
    gpus = [{**asdict(g), "load_gbps": t.load_gbps(g.index, concurrent=sizes[g.index])} for g in t.gpus]
    rcs = [{**asdict(r), "gpus": [g.index for g in t.gpus if g.root_complex == r.name]}
           for r in t.root_complexes]
    return {
        "name": t.name,
        "source": t.source,
        "gpus": gpus,
        "contention_groups": t.contention_groups(),
        "root_complexes": rcs,
        "p2p": t.p2p,
        "host_memory_bytes": t.host_memory_bytes,
    }


def _fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _plural(n: int, word: str, words: str) -> str:
    return f"{n} {word if n == 1 else words}"


def _header(t: Topology) -> str:
    p2p = "GPU peer-to-peer" if t.p2p else "no GPU peer-to-peer"
    host = f", host memory {_fmt_bytes(t.host_memory_bytes)}" if t.host_memory_bytes else ""
    return (f"topology {t.name} ({t.source}): {_plural(t.num_gpus, 'GPU', 'GPUs')}, "
            f"{_plural(len(t.root_complexes), 'root complex', 'root complexes')}{host}, {p2p}")


def _gpu_line(t: Topology, index: int, group_size: int, name_width: int) -> str:
    g = t.gpus[index]
    alone = t.load_gbps(index, concurrent=1)
    loads = f"{alone:.2f} alone"
    if group_size > 1:
        loads += f", {t.load_gbps(index, concurrent=group_size):.2f} with its group of {group_size}"
    return (f"  gpu {g.index:<{len(str(t.num_gpus - 1))}}  {g.name:<{name_width}}  {_fmt_bytes(g.memory_bytes)}"
            f"  {g.pci_bus_id}  link {g.link_gbps:.2f} GB/s  ({loads})")


def render_text(t: Topology) -> str:
    """A readable report: one line per root complex, one per GPU under it, then the contention groups."""
    sizes = _group_sizes(t)
    width = max(len(g.name) for g in t.gpus)
    lines = [_header(t)]
    for rc in t.root_complexes:
        lines.append(f"{rc.name}  numa {rc.numa_node}  uplink {rc.uplink_gbps:.2f} GB/s")
        members = [g.index for g in t.gpus if g.root_complex == rc.name]
        lines += [_gpu_line(t, i, sizes[i], width) for i in members] or ["  (no GPUs)"]
    lines.append("contention groups: " + " ".join(str(group) for group in t.contention_groups()))
    return "\n".join(lines) + "\n"
