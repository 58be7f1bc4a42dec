"""Plain, frozen description of a machine: GPUs, the CPU root complexes they hang under, and their links.

Units: bytes for memory, GB/s (1e9 bytes per second) for bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from topology.errors import TopologyError

__all__ = ["Gpu", "RootComplex", "Topology"]


@dataclass(frozen=True)
class Gpu:
    """One accelerator (a torchrun rank). On a CPU-only machine, a CPU stand-in with a memory budget."""

    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str
    root_complex: str
    """Name of the RootComplex this GPU's PCIe link leads to."""
    numa_node: int
    link_gbps: float
    """Bandwidth of this GPU's own PCIe link (host<->GPU, one direction), GB/s."""


@dataclass(frozen=True)
class RootComplex:
    """A CPU's PCIe root: the GPUs under it share its uplink to host memory (contention)."""

    name: str
    numa_node: int
    uplink_gbps: float
    """Bandwidth of the uplink shared by every GPU under this root complex, GB/s."""


@dataclass(frozen=True)
class Topology:
    """A machine: its GPUs and root complexes, no GPU peer-to-peer unless `p2p` says so."""

    name: str
    gpus: tuple[Gpu, ...]
    root_complexes: tuple[RootComplex, ...]
    source: str
    """Where this description came from: "preset:2+2", "file:/path/server.yaml", ..."""
    host_memory_bytes: int = 0
    p2p: bool = False
    """True when GPUs can copy to each other directly (NVLink or PCIe P2P)."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def root_complex(self, name: str) -> RootComplex:
        for rc in self.root_complexes:
            if rc.name == name:
                return rc
        raise TopologyError(f"no root complex named {name!r}; known: {[r.name for r in self.root_complexes]}")

    def contention_groups(self) -> list[list[int]]:
        """GPU indices grouped by the root complex whose uplink they share, in root-complex order."""
        return [[g.index for g in self.gpus if g.root_complex == rc.name] for rc in self.root_complexes
                if any(g.root_complex == rc.name for g in self.gpus)]

    def shared(self, a: int, b: int) -> bool:
        """True when gpus a and b are distinct and share a root complex uplink."""
        return a != b and self.gpus[a].root_complex == self.gpus[b].root_complex

    def load_gbps(self, gpu: int, concurrent: float = 1.0) -> float:
        """Host->GPU bandwidth of `gpu` while `concurrent` GPUs of its group (itself included) copy at once.

        `concurrent` may be fractional: an expected number of overlapping copies (see partition.mapping).
        """
        g = self.gpus[gpu]
        uplink = self.root_complex(g.root_complex).uplink_gbps
        return min(g.link_gbps, uplink / max(1.0, concurrent))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        d["root_complexes"] = [asdict(r) for r in self.root_complexes]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "topology") -> "Topology":
        from topology.layout import topology_from_dict  # one parser, with the strict checks

        return topology_from_dict(d, where)


def _check(t: Topology) -> None:
    if not t.gpus:
        raise TopologyError(f"topology {t.name!r} has no GPUs; expected at least one")
    names = [r.name for r in t.root_complexes]
    if len(set(names)) != len(names):
        raise TopologyError(f"topology {t.name!r}: duplicate root complex names {names}")
    for i, g in enumerate(t.gpus):
        if g.index != i:
            raise TopologyError(f"topology {t.name!r}: gpu #{i} has index {g.index}; indices must be 0..N-1 in order")
        if g.root_complex not in names:
            raise TopologyError(
                f"topology {t.name!r}: gpu {i} references root complex {g.root_complex!r}, which does not exist; "
                f"known: {names}")
        if g.memory_bytes <= 0 or g.link_gbps <= 0:
            raise TopologyError(f"topology {t.name!r}: gpu {i} needs memory_bytes > 0 and link_gbps > 0, "
                                f"found {g.memory_bytes} and {g.link_gbps}")
    for r in t.root_complexes:
        if r.uplink_gbps <= 0:
            raise TopologyError(f"topology {t.name!r}: root complex {r.name!r} needs uplink_gbps > 0, found {r.uplink_gbps}")
