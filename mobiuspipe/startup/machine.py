"""The machine a job runs on, when it has GPUs: discovered (NVML + sysfs) and narrowed to the GPUs CUDA
shows the job, in CUDA's order, so that gpu g of the topology is rank g's device and cross mapping
follows the real root complexes."""

from __future__ import annotations

import torch

from mobiuspipe.errors import WorldSizeError
from topology import Topology
from topology.discover import discover
from topology.select import bus_id_of, select_gpus

__all__ = ["cuda_bus_ids", "discovered_topology"]


def cuda_bus_ids(num_gpus: int) -> list[str]:
    """PCI bus ids of CUDA devices 0..num_gpus-1 (rank r uses device r); WorldSizeError if CUDA shows fewer."""
    shown = torch.cuda.device_count()
    if shown < num_gpus:
        raise WorldSizeError(
            f"the job needs {num_gpus} gpus but CUDA shows this process {shown}: every rank must see all "
            f"the job's gpus (do not narrow CUDA_VISIBLE_DEVICES per rank), or set plan.topology"
        )
    props = [torch.cuda.get_device_properties(i) for i in range(num_gpus)]
    return [bus_id_of(p.pci_domain_id, p.pci_bus_id, p.pci_device_id) for p in props]


def discovered_topology(num_gpus: int, machine: Topology | None = None) -> Topology:
    """The topology of the job's num_gpus gpus: `machine` (default: discover() of this host) narrowed to
    CUDA's devices 0..num_gpus-1 by bus id."""
    return select_gpus(machine if machine is not None else discover(), cuda_bus_ids(num_gpus))
