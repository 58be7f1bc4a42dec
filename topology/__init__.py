"""Machine topology: GPUs, the root complexes whose uplinks they share, presets and layout files."""

from topology.errors import TopologyError
from topology.layout import load_topology, save_topology
from topology.presets import PRESETS, cpu_standin, preset
from topology.types import Gpu, RootComplex, Topology

__all__ = [
    "Gpu",
    "RootComplex",
    "Topology",
    "TopologyError",
    "load_topology",
    "save_topology",
    "preset",
    "cpu_standin",
    "PRESETS",
]
