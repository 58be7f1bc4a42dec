"""Layout files: a Topology read from and written to YAML or JSON by the one strict loader (foundation.loader).

A layout file holds what `Topology.to_dict()` produces (docs/worked-example.md shows this same schema, and a test
loads it):

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
        # optional too: uuid, pcie_gen, pcie_width, cpu_affinity ("0-11,24-35"), tflops (peak dense
        # fp16/bf16 TFLOPS, for a gpu partition/spec/hardware.py does not list), fp32_tflops (its dense fp32 rate)
      - {name: NVIDIA GeForce RTX 3090 Ti, memory_bytes: 24GiB, pci_bus_id: "0000:1b:00.0",
         root_complex: rc0, link_gbps: 15.75, switch: sw0}
    nvlinks: [{a: 0, b: 1, links: 4, gbps: 56.0}]            # optional
    p2p: [[X, OK], [OK, X]]          # optional nvidia-smi P2P statuses per gpu pair; [] = none
    nvme:                            # optional: drives for the SSD tier (switch, model: optional)
      - {name: nvme0, pci_bus_id: "0000:3d:00.0", root_complex: rc0, numa_node: 0, link_gbps: 7.88}
    measured: null                   # optional: what `mobiuspipe topology --probe` measured: h2d_gbps,
                                     # h2d_group_gbps (per gpu), d2d_gbps (gpu x gpu), matmul_tflops
                                     # and matmul_fp32_tflops (per gpu), ssd_dir, ssd_read_gbps,
                                     # ssd_write_gbps, host_adam_params_per_s, host_cores,
                                     # message_latency_s, message_gbps, message_send_s,
                                     # message_recv_s, step_overhead_s, notes
    notes: []                        # optional: what discovery could not find out

Memory strings take B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), with an
optional space and a decimal number ("1.5 TiB"); they must come to a whole number of bytes.
Bandwidths are GB/s (1e9 bytes per second). Every problem of a file is reported at once, in one error, each
with its dotted key (`gpus[2].memory_bytes`), what was expected, what was found and the fix: all the missing
keys of every part, not the first alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundation.loader import (
    Problem,
    format_problems,
    found_text,
    from_plain,
    read_file,
    save_file,
)
from foundation.units import as_bytes
from topology.errors import TopologyError
from topology.layout_checks import LAYOUT_CHECKS
from topology.presets import PRESETS
from topology.types import Topology

__all__ = ["topology_from_dict", "load_topology", "save_topology", "parse_bytes", "LAYOUT_CHECKS", "layout_defaults"]

_SUFFIXES = (".yaml", ".yml", ".json")
_HEADER = '# mobiuspipe topology layout: memory in bytes ("24GiB" also accepted), bandwidth in GB/s\n'
_FIX = "correct the layout file (`mobiuspipe topology --save FILE.yaml` writes one for this machine)"


def parse_bytes(value: Any, where: str, key: str) -> int:
    """Bytes from an int or a string like "24GiB", "24 GB", "1.5TiB"; TopologyError naming `where` and `key`."""
    try:
        return as_bytes(value)
    except ValueError as e:
        fix = f"write bytes, or a size with its unit such as `{key.rsplit('.', 1)[-1]}: 24GiB`"
        raise TopologyError(format_problems(where, [Problem(key, str(e), found_text(value), fix)])) from None


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
