"""Named, built-in topologies (servers people build) and a CPU stand-in for GPU-less machines."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from topology.errors import TopologyError
from topology.pci import pcie_gbps
from topology.types import Gpu, Measured, NvLink, RootComplex, Switch, Topology

__all__ = [
    "PCIE3_X16_GBPS",
    "PCIE4_X16_GBPS",
    "RTX_3090_TI",
    "RTX_3090_TI_BYTES",
    "PRESETS",
    "preset",
    "cpu_standin",
    "STANDIN_NAME",
    "STANDIN_MESSAGES",
    "DEFAULT_RESERVE_BYTES",
    "reserve_bytes",
]

PCIE3_X16_GBPS = pcie_gbps(3, 16)
"""PCIe 3.0 x16, one direction: 8 GT/s x 16 lanes x 128b/130b encoding / 8 bits = 15.75 GB/s."""
PCIE4_X16_GBPS = pcie_gbps(4, 16)
"""PCIe 4.0 x16, one direction: 31.51 GB/s."""

RTX_3090_TI = "NVIDIA GeForce RTX 3090 Ti"
RTX_3090_TI_BYTES = 24 * 2**30
RTX_3090 = "NVIDIA GeForce RTX 3090"
NVLINK3_LINK_GBPS = 14.0625
"""One third-generation NVLink on an RTX 3090 bridge, one direction (4 links = 56.25 GB/s)."""


def _gpu(i: int, name: str, bus: int, rc: str, numa: int, gen: int, switch: str = "") -> Gpu:
    return Gpu(
        index=i,
        name=name,
        memory_bytes=RTX_3090_TI_BYTES,
        pci_bus_id=f"0000:{bus:02x}:00.0",
        root_complex=rc,
        numa_node=numa,
        link_gbps=pcie_gbps(gen, 16),
        switch=switch,
        pcie_gen=gen,
        pcie_width=16,
    )


def _two_root_complexes(name: str, split: tuple[int, int]) -> Topology:
    """Four RTX 3090 Ti on PCIe 3.0 x16 behind one switch per root complex: `split` GPUs under rc0 / rc1.

    The Mobius paper's servers: the GPUs of a root complex share its one x16 uplink; no GPU P2P.
    A lone GPU sits directly on its root port.
    """
    rcs = (RootComplex("rc0", 0, PCIE3_X16_GBPS), RootComplex("rc1", 1, PCIE3_X16_GBPS))
    switches = tuple(Switch(f"sw{r}", f"rc{r}", PCIE3_X16_GBPS) for r in (0, 1) if split[r] > 1)
    buses = {"2+2": (0x1A, 0x1B, 0x88, 0x89), "3+1": (0x1A, 0x1B, 0x1C, 0x88)}[name]
    owners = [0] * split[0] + [1] * split[1]
    gpus = tuple(
        _gpu(i, RTX_3090_TI, buses[i], f"rc{r}", r, 3, f"sw{r}" if split[r] > 1 else "") for i, r in enumerate(owners)
    )
    return Topology(name=name, gpus=gpus, root_complexes=rcs, source=f"preset:{name}", switches=switches)


def _single_root_complex() -> Topology:
    """Four RTX 3090 Ti on PCIe 3.0 x16 under one root complex: two switches of two, on two root ports."""
    rc = RootComplex("rc0", 0, 2 * PCIE3_X16_GBPS)
    switches = (Switch("sw0", "rc0", PCIE3_X16_GBPS), Switch("sw1", "rc0", PCIE3_X16_GBPS))
    gpus = tuple(_gpu(i, RTX_3090_TI, 0x1A + i, "rc0", 0, 3, f"sw{i // 2}") for i in range(4))
    return Topology(name="4", gpus=gpus, root_complexes=(rc,), source="preset:4", switches=switches)


def _eight_dual_socket() -> Topology:
    """Eight RTX 3090 on PCIe 4.0 x16, two sockets, two switches of two GPUs on each socket's root complex."""
    rcs = (RootComplex("rc0", 0, 2 * PCIE4_X16_GBPS), RootComplex("rc1", 1, 2 * PCIE4_X16_GBPS))
    switches = tuple(Switch(f"sw{k}", f"rc{k // 2}", PCIE4_X16_GBPS) for k in range(4))
    gpus = tuple(
        _gpu(i, RTX_3090, 0x1A + i if i < 4 else 0x80 + i, f"rc{i // 4}", i // 4, 4, f"sw{i // 2}") for i in range(8)
    )
    gpus = tuple(Gpu(**{**g.__dict__, "memory_bytes": RTX_3090_TI_BYTES}) for g in gpus)
    return Topology(
        name="8-dual-socket", gpus=gpus, root_complexes=rcs, source="preset:8-dual-socket", switches=switches
    )


def _two_nvlink_pairs() -> Topology:
    """Four RTX 3090 on PCIe 4.0 x16 root ports, two per socket, each pair joined by a 4-link NVLink bridge."""
    rcs = (RootComplex("rc0", 0, 2 * PCIE4_X16_GBPS), RootComplex("rc1", 1, 2 * PCIE4_X16_GBPS))
    gpus = tuple(_gpu(i, RTX_3090, (0x1A, 0x3D, 0x88, 0xB1)[i], f"rc{i // 2}", i // 2, 4) for i in range(4))
    links = (NvLink(0, 1, 4, 4 * NVLINK3_LINK_GBPS), NvLink(2, 3, 4, 4 * NVLINK3_LINK_GBPS))
    pair = lambda a, b: "X" if a == b else ("OK" if a // 2 == b // 2 else "GNS")  # noqa: E731
    p2p = tuple(tuple(pair(a, b) for b in range(4)) for a in range(4))
    return Topology(
        name="2x2-nvlink", gpus=gpus, root_complexes=rcs, source="preset:2x2-nvlink", nvlinks=links, p2p=p2p
    )


PRESETS: Mapping[str, Topology] = MappingProxyType(
    {
        "2+2": _two_root_complexes("2+2", (2, 2)),
        "3+1": _two_root_complexes("3+1", (3, 1)),
        "4": _single_root_complex(),
        "8-dual-socket": _eight_dual_socket(),
        "2x2-nvlink": _two_nvlink_pairs(),
    }
)
"""Built-in topologies by name (read-only). Iterating yields the names."""


def preset(name: str) -> Topology:
    """The built-in topology called `name`; TopologyError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise TopologyError(
            f"unknown topology preset {name!r}; known presets: {sorted(PRESETS)} (or give a .yaml/.json layout file)"
        ) from None


STANDIN_NAME = "cpu-standin"
"""The gpu name of a CPU stand-in."""

DEFAULT_RESERVE_BYTES = 1 << 30
"""Memory of each real gpu a plan leaves to what the runtime does not allocate itself: the CUDA context (0.74 GiB on
an H200 with CUDA 13: gpu_check's "reserved / used by the process" row, 1.61 GiB used less 0.87 GiB in the allocator,
BENCHMARKS.md), NCCL's buffers, the allocator's rounding (bytes; `mobiuspipe partition --reserve-gib`'s default, a
run's plan.reserve_mb when null)."""


def reserve_bytes(topo: Topology, reserve_mb: float | None = None) -> int:
    """Bytes of each gpu a plan for `topo` leaves alone: reserve_mb MiB if given; else 0 on CPU stand-ins (their
    budget is the arena's own memory: no context) and DEFAULT_RESERVE_BYTES on real gpus, a preset's or a layout's
    too (the machine the plan is for has a CUDA context)."""
    if reserve_mb is not None:
        return int(reserve_mb * 2**20)
    return 0 if all(g.name == STANDIN_NAME for g in topo.gpus) else DEFAULT_RESERVE_BYTES


STANDIN_MESSAGES = Measured(
    message_latency_s=100e-6,
    message_gbps=1.0,
    message_send_s=60e-6,
    message_recv_s=900e-6,
    notes=("typical stand-in message costs (scripts/bench_standin_plans.py), not measured on this machine",),
)
"""What a message between two CPU stand-in ranks of one host typically costs (topology.types.Measured's legend),
traced by scripts/bench_standin_plans.py on this project's 2-core VM: posting it 58-66 us; taking it 0.4-1.8 ms
(mostly waiting for the sender's process to get a core), 0.9 ms in the 4-stage run; gloo's latency 0.1 ms
(`topology --probe`). A run that plans for stand-ins it has not probed plans with these (mobiuspipe.startup.
config_plan.run_topology); `topology --probe` and `profile --refine` measure a machine's own."""


def cpu_standin(
    num_gpus: int, memory_bytes: int, link_gbps: float = 10.0, measured: Measured | None = None
) -> Topology:
    """`num_gpus` CPU stand-ins ("cpu-standin"), each with a `memory_bytes` budget, under one root complex "host";
    `measured`: what is known of its messages (e.g. STANDIN_MESSAGES), None: nothing.

    The uplink is `link_gbps * num_gpus`: copies between CPU buffers do not contend for one shared link
    the way PCIe transfers under a root complex do, so every stand-in keeps its full `link_gbps` even
    when all copy at once.
    """
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise TopologyError(f"cpu_standin needs num_gpus >= 1 (an int), found {num_gpus!r}")
    if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool) or memory_bytes < 1:
        raise TopologyError(f"cpu_standin needs memory_bytes >= 1 (each stand-in's budget), found {memory_bytes!r}")
    if link_gbps <= 0:
        raise TopologyError(f"cpu_standin needs link_gbps > 0, found {link_gbps}")
    rc = RootComplex("host", 0, float(link_gbps) * num_gpus)
    gpus = tuple(
        Gpu(
            index=i,
            name=STANDIN_NAME,
            memory_bytes=memory_bytes,
            pci_bus_id=f"cpu:{i}",
            root_complex="host",
            numa_node=0,
            link_gbps=float(link_gbps),
        )
        for i in range(num_gpus)
    )
    name, source = f"cpu-standin-{num_gpus}", "cpu-standin"
    return Topology(name=name, gpus=gpus, root_complexes=(rc,), source=source, measured=measured)
