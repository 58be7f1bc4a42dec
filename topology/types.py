"""Plain, frozen description of a machine: GPUs, the PCIe tree above them (root complexes, switches),
NVMe drives, NVLink pairs, peer-to-peer status and what was measured.

Units: bytes for memory, GB/s (1e9 bytes per second, one direction) for bandwidth. An empty string or a
zero means "none" or "unknown" (a GPU directly on a root port has switch ""; pcie_gen 0 = unknown).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from foundation.units import as_bytes
from topology.errors import TopologyError

__all__ = ["Gpu", "RootComplex", "Switch", "Nvme", "NvLink", "Measured", "Topology", "LEVELS", "P2P_STATUSES"]

LEVELS = ("X", "NV#", "PIX", "PXB", "PHB", "NODE", "SYS")
"""nvidia-smi topo -m labels, nearest first: self, NVLink, one switch, several switches, host bridge,
same NUMA node across host bridges, across sockets."""

P2P_STATUSES = ("X", "OK", "NS", "GNS", "CNS", "TNS", "DR", "U")
"""nvidia-smi topo -p2p statuses: self, ok, not supported, GPU / chipset / topology not supported,
disabled by regkey, unknown."""

_MEMORY = {
    "convert": as_bytes,
    "fix": 'write bytes, or a size with its unit such as "24GiB" or "24GB"',
    "example": "24GiB",
}
"""Field metadata of a memory size: a layout file may write "24GiB" (foundation.loader converts it)."""


def _example(text: str) -> dict:
    """Field metadata: the value the loader's fix suggests when a layout file leaves the key out."""
    return {"example": text}


@dataclass(frozen=True)
class Gpu:
    """One accelerator (a torchrun rank). On a CPU-only machine, a CPU stand-in with a memory budget."""

    index: int
    name: str
    memory_bytes: int = field(metadata=_MEMORY)
    pci_bus_id: str = field(metadata=_example('"0000:1a:00.0"'))
    root_complex: str = field(metadata=_example("rc0"))
    """Name of the RootComplex this GPU's PCIe path leads to."""
    numa_node: int
    link_gbps: float = field(metadata=_example("15.75"))
    """Bandwidth of this GPU's own PCIe link (host<->GPU, one direction), GB/s; measured when probed."""
    uuid: str = ""
    switch: str = ""
    """Name of the PCIe switch right above this GPU; "" when it sits directly on a root port."""
    pcie_gen: int = 0
    pcie_width: int = 0
    cpu_affinity: str = ""
    """CPUs close to this GPU, as a cpulist ("0-11,24-35"); "" when unknown."""
    tflops: float = 0.0
    """Peak dense fp16/bf16 tensor throughput, 1e12 FLOP/s, for a GPU that partition/spec/hardware.py does not list
    (a layout file's, from the vendor's datasheet); 0 = the table's figure for its name."""
    fp32_tflops: float = 0.0
    """Dense fp32 throughput on CUDA cores (an fp32 run's rate: TF32 stays off), 1e12 FLOP/s, from the vendor's
    datasheet; 0 = the table's figure for its name, else the fp32 matmul rate a probe measured, else tflops."""


@dataclass(frozen=True)
class RootComplex:
    """A CPU's PCIe root (host bridge): the GPUs under it share its uplink to host memory (contention)."""

    name: str
    numa_node: int = field(metadata=_example("0"))
    uplink_gbps: float = field(metadata=_example("15.75"))
    """Bandwidth all devices under this root complex share towards host memory, GB/s."""


@dataclass(frozen=True)
class Switch:
    """A PCIe switch: the devices below it share its upstream link."""

    name: str
    root_complex: str
    uplink_gbps: float
    parent: str = ""
    """The switch above this one, "" when it hangs directly off the root complex."""


@dataclass(frozen=True)
class Nvme:
    """An NVMe drive: where the SSD tier can live, and which root complex its traffic crosses."""

    name: str
    pci_bus_id: str
    root_complex: str
    numa_node: int
    link_gbps: float
    switch: str = ""
    model: str = ""


@dataclass(frozen=True)
class NvLink:
    """GPUs a and b joined by `links` NVLinks carrying `gbps` in all, one direction."""

    a: int
    b: int
    links: int
    gbps: float


@dataclass(frozen=True)
class Measured:
    """What `--probe` measured (GB/s; 0 = not measured) and the notes on what it skipped."""

    h2d_gbps: tuple[float, ...] = ()
    """Per gpu, host->gpu while it copies alone."""
    h2d_group_gbps: tuple[float, ...] = ()
    """Per gpu, host->gpu while its whole contention group copies at once."""
    d2d_gbps: tuple[tuple[float, ...], ...] = ()
    """gpu a -> gpu b, 0 on the diagonal."""
    matmul_tflops: tuple[float, ...] = ()
    """Per gpu, a large bf16 matmul's rate (1e12 FLOP/s; a lower bound of the datasheet's dense peak, which cuBLAS
    reaches 70-90% of): the planner's peak of a gpu its table does not list and the layout gives no tflops for."""
    matmul_fp32_tflops: tuple[float, ...] = ()
    """Per gpu, the same matmul's rate in fp32 (TF32 off, as a run computes): the planner's fp32 rate of a gpu its
    table does not list and the layout gives no fp32_tflops for."""
    ssd_dir: str = ""
    ssd_read_gbps: float = 0.0
    ssd_write_gbps: float = 0.0
    host_adam_params_per_s: float = 0.0
    """Parameters per second one rank's host optimizer updates while every rank (one per gpu) updates at once (the
    planner's host-update rate, per rank)."""
    notes: tuple[str, ...] = ()
    host_cores: float = 0.0
    """Cores one-thread processes computing at once get, in units of one computing alone (CPU stand-ins'
    computations share them in the simulator; topology.probe_cpu.probe_host_cores)."""
    message_latency_s: float = 0.0
    """Seconds one message between two ranks of this host takes besides its bytes (probe_cpu.probe_messages)."""
    message_gbps: float = 0.0
    """GB/s of those messages beyond the latency."""
    message_send_s: float = 0.0
    """Seconds a rank's own thread is busy posting one message to another rank (CPU stand-ins: the copy into
    the send and gloo's call; a traced run measures it, mobiuspipe.profiling.refine), before its next action."""
    message_recv_s: float = 0.0
    """Seconds a rank's own thread spends on one message from another rank once it has arrived and the thread
    reached its receive (CPU stand-ins: posting the receive, and gloo's delivery when the cores are busy; a
    traced run measures it, mobiuspipe.profiling.refine), before the computation that needs it."""
    step_overhead_s: float = 0.0
    """Seconds each training step takes beyond its pipeline schedule: the loop's own work from the end of one
    step's schedule to the start of the next (the collectives of the loss and metrics, clipping, starting the
    updates, the next batch; a traced run measures it, mobiuspipe.profiling.refine), added to the step."""


@dataclass(frozen=True)
class Topology:
    """A machine: GPUs, the PCIe tree above them, drives, NVLinks, P2P status, measurements."""

    name: str
    gpus: tuple[Gpu, ...]
    root_complexes: tuple[RootComplex, ...]
    source: str
    """Where this description came from: "preset:2+2", "file:/path/server.yaml", "discovered:nvml+sysfs"."""
    host_memory_bytes: int = field(default=0, metadata=_MEMORY)
    switches: tuple[Switch, ...] = ()
    nvme: tuple[Nvme, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()
    p2p: tuple[tuple[str, ...], ...] = ()
    """P2P read status per gpu pair as nvidia-smi prints it (X, OK, NS, GNS, CNS, TNS, DR, U); () = none."""
    measured: Measured | None = None
    notes: tuple[str, ...] = ()
    """What discovery could not find out, said once each."""

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

    def switch(self, name: str) -> Switch:
        for s in self.switches:
            if s.name == name:
                return s
        raise TopologyError(f"no switch named {name!r}; known: {[s.name for s in self.switches]}")

    def contention_groups(self) -> list[list[int]]:
        """GPU indices grouped by the root complex whose uplink they share, in root-complex order."""
        groups = [[g.index for g in self.gpus if g.root_complex == rc.name] for rc in self.root_complexes]
        return [g for g in groups if g]

    def shared(self, a: int, b: int) -> bool:
        """True when gpus a and b are distinct and share a root complex uplink."""
        return a != b and self.gpus[a].root_complex == self.gpus[b].root_complex

    def switch_chain(self, gpu: int) -> list[str]:
        """Switches above a gpu, nearest first."""
        chain, name = [], self.gpus[gpu].switch
        while name:
            chain.append(name)
            name = self.switch(name).parent
        return chain

    def load_gbps(self, gpu: int, concurrent: float = 1.0) -> float:
        """Host->GPU bandwidth of `gpu` while `concurrent` GPUs of its group (itself included) copy at once.

        Each shared link on the way (every switch above it, then the root complex uplink) is split evenly
        between the copying GPUs that cross it, the group's GPUs filling the nearest switch first.
        `concurrent` may be fractional: an expected number of overlapping copies (see partition.rules.mapping).
        """
        g = self.gpus[gpu]
        k = max(1.0, concurrent)
        bw = g.link_gbps
        for name in self.switch_chain(gpu):
            below = sum(1 for i in range(self.num_gpus) if name in self.switch_chain(i))
            bw = min(bw, self.switch(name).uplink_gbps / min(k, below))
        return min(bw, self.root_complex(g.root_complex).uplink_gbps / k)

    def nvlink(self, a: int, b: int) -> NvLink | None:
        for link in self.nvlinks:
            if {link.a, link.b} == {a, b}:
                return link
        return None

    def p2p_ok(self, a: int, b: int) -> bool:
        """True when gpu a can copy to gpu b directly (NVLink, or PCIe P2P reported OK)."""
        if a == b or self.nvlink(a, b):
            return a != b
        return bool(self.p2p) and self.p2p[a][b] == "OK"

    def level(self, a: int, b: int) -> str:
        """The nvidia-smi topo -m label of the path between gpus a and b (NV# with the link count)."""
        if a == b:
            return "X"
        if link := self.nvlink(a, b):
            return f"NV{link.links}"
        ca, cb = self.switch_chain(a), self.switch_chain(b)
        common = [s for s in ca if s in cb]
        if common:
            return "PIX" if ca[0] == cb[0] else "PXB"
        if self.shared(a, b):
            return "PHB"
        return "NODE" if self.gpus[a].numa_node == self.gpus[b].numa_node else "SYS"

    def to_dict(self) -> dict:
        """Plain data (lists, dicts, numbers, strings) that topology.layout.topology_from_dict, the one parser with
        the strict checks, and layout files accept back."""
        return {k: _plain(v) for k, v in asdict(self).items()}


def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _check(t: Topology) -> None:
    if not t.gpus:
        raise TopologyError(f"topology {t.name!r} has no GPUs; expected at least one")
    rcs = _unique(t, "root complex", [r.name for r in t.root_complexes])
    sws = _unique(t, "switch", [s.name for s in t.switches])
    for i, g in enumerate(t.gpus):
        if g.index != i:
            raise TopologyError(f"topology {t.name!r}: gpu #{i} has index {g.index}; indices must be 0..N-1 in order")
        _refers(t, f"gpu {i}", g.root_complex, rcs, g.switch, sws)
        if g.memory_bytes < 0 or g.link_gbps <= 0:
            raise TopologyError(
                f"topology {t.name!r}: gpu {i} needs memory_bytes >= 0 (0 = unknown) and "
                f"link_gbps > 0, found {g.memory_bytes} and {g.link_gbps}"
            )
    for s in t.switches:
        _refers(t, f"switch {s.name!r}", s.root_complex, rcs, s.parent, sws)
    for s in t.switches:
        up, seen = s.parent, {s.name}
        while up and up not in seen:  # every parent exists (checked above): this ends at "" or in a loop
            seen.add(up)
            up = t.switch(up).parent
        if up:
            raise TopologyError(f"topology {t.name!r}: the parents above switch {s.name!r} form a loop")
    for d in t.nvme:
        _refers(t, f"nvme {d.name!r}", d.root_complex, rcs, d.switch, sws)
    for x in [*t.root_complexes, *t.switches]:
        if x.uplink_gbps <= 0:
            raise TopologyError(f"topology {t.name!r}: {x.name!r} needs uplink_gbps > 0, found {x.uplink_gbps}")
    _check_pairs(t)


def _unique(t: Topology, what: str, names: list[str]) -> set[str]:
    if len(set(names)) != len(names):
        raise TopologyError(f"topology {t.name!r}: duplicate {what} names {names}")
    return set(names)


def _refers(t: Topology, who: str, rc: str, rcs: set[str], switch: str, sws: set[str]) -> None:
    if rc not in rcs:
        raise TopologyError(
            f"topology {t.name!r}: {who} references root complex {rc!r}, which does not exist; known: {sorted(rcs)}"
        )
    if switch and switch not in sws:
        raise TopologyError(
            f"topology {t.name!r}: {who} references switch {switch!r}, which does not exist; known: {sorted(sws)}"
        )


def _check_pairs(t: Topology) -> None:
    n = t.num_gpus
    for link in t.nvlinks:
        if not (0 <= link.a < n and 0 <= link.b < n) or link.a == link.b or link.links < 1 or link.gbps <= 0:
            raise TopologyError(
                f"topology {t.name!r}: nvlink {link} needs two distinct gpus in 0..{n - 1}, links >= 1 and gbps > 0"
            )
    if t.p2p and (len(t.p2p) != n or any(len(row) != n for row in t.p2p)):
        raise TopologyError(f"topology {t.name!r}: p2p must be a {n} x {n} matrix of statuses, found {len(t.p2p)} rows")
