"""Named, built-in topologies: the paper's two-root-complex servers and a CPU stand-in for GPU-less machines."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from topology.errors import TopologyError
from topology.types import Gpu, RootComplex, Topology

__all__ = ["PCIE3_X16_GBPS", "RTX_3090_TI", "RTX_3090_TI_BYTES", "PRESETS", "preset", "cpu_standin"]

PCIE3_X16_GBPS = 8 * 16 * (128 / 130) / 8
"""PCIe 3.0 x16, one direction: 8 GT/s x 16 lanes x 128b/130b encoding / 8 bits = 15.75 GB/s."""

RTX_3090_TI = "NVIDIA GeForce RTX 3090 Ti"
RTX_3090_TI_BYTES = 24 * 2**30

# Made-up but plausible NVML bus ids of a dual-socket server: the low buses hang under socket 0.
_BUS_IDS = {
    "2+2": ("00000000:1A:00.0", "00000000:3D:00.0", "00000000:88:00.0", "00000000:B1:00.0"),
    "3+1": ("00000000:1A:00.0", "00000000:3D:00.0", "00000000:5E:00.0", "00000000:B1:00.0"),
}


def _two_root_complexes(name: str, split: tuple[int, int]) -> Topology:
    """Four RTX 3090 Ti on PCIe 3.0 x16, `split[0]` under rc0 (numa 0) and `split[1]` under rc1 (numa 1)."""
    rcs = (RootComplex("rc0", 0, PCIE3_X16_GBPS), RootComplex("rc1", 1, PCIE3_X16_GBPS))
    owners = [0] * split[0] + [1] * split[1]
    gpus = tuple(
        Gpu(index=i, name=RTX_3090_TI, memory_bytes=RTX_3090_TI_BYTES, pci_bus_id=_BUS_IDS[name][i],
            root_complex=rcs[r].name, numa_node=rcs[r].numa_node, link_gbps=PCIE3_X16_GBPS)
        for i, r in enumerate(owners))
    return Topology(name=name, gpus=gpus, root_complexes=rcs, source=f"preset:{name}", p2p=False)


PRESETS: Mapping[str, Topology] = MappingProxyType({
    "2+2": _two_root_complexes("2+2", (2, 2)),
    "3+1": _two_root_complexes("3+1", (3, 1)),
})
"""Built-in topologies by name (read-only). Iterating yields the names."""


def preset(name: str) -> Topology:
    """The built-in topology called `name`; TopologyError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise TopologyError(
            f"unknown topology preset {name!r}; known presets: {sorted(PRESETS)} "
            f"(or give a .yaml/.json layout file)") from None


def cpu_standin(num_gpus: int, memory_bytes: int, link_gbps: float = 10.0) -> Topology:
    """`num_gpus` CPU stand-ins ("cpu-standin"), each with a `memory_bytes` budget, under one root complex "host".

    The uplink is `link_gbps * num_gpus`: copies between CPU buffers do not contend for one shared link
    the way PCIe transfers under a root complex do, so every stand-in keeps its full `link_gbps` even
    when all copy at once.
    """
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise TopologyError(f"cpu_standin needs num_gpus >= 1 (an int), found {num_gpus!r}")
    if link_gbps <= 0:
        raise TopologyError(f"cpu_standin needs link_gbps > 0, found {link_gbps}")
    rc = RootComplex("host", 0, float(link_gbps) * num_gpus)
    gpus = tuple(Gpu(index=i, name="cpu-standin", memory_bytes=memory_bytes, pci_bus_id=f"cpu:{i}",
                     root_complex="host", numa_node=0, link_gbps=float(link_gbps))
                 for i in range(num_gpus))
    return Topology(name=f"cpu-standin-{num_gpus}", gpus=gpus, root_complexes=(rc,), source="cpu-standin")
