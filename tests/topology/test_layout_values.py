"""Layout values found by fuzzing that loaded but meant nothing: refused, each named by its key."""

import math

import pytest

from topology import TopologyError, preset
from topology.layout import topology_from_dict


def _error(d: dict) -> str:
    with pytest.raises(TopologyError) as e:
        topology_from_dict(d, "box.yaml")
    return str(e.value)


def test_numa_nodes_and_pcie_links_in_range():
    d = preset("2+2").to_dict()
    d["gpus"][0].update(pcie_gen=-1, pcie_width=-16, numa_node=-2)
    d["root_complexes"][1]["numa_node"] = -5
    msg = _error(d)
    assert "4 errors" in msg
    for key in ("gpus[0].numa_node", "gpus[0].pcie_gen", "gpus[0].pcie_width", "root_complexes[1].numa_node"):
        assert f") {key}: expected an integer >= " in msg, key
    d = preset("2+2").to_dict()
    d["gpus"][0].update(numa_node=-1, pcie_gen=0, pcie_width=0)  # unknown, as sysfs and NVML may say
    assert topology_from_dict(d, "box.yaml").gpus[0].numa_node == -1


def test_measured_bandwidths_are_finite_and_not_negative():
    d = preset("2+2").to_dict()
    d["measured"] = {"h2d_gbps": [12.0, -1.0, 12.0, 12.0], "d2d_gbps": [[0.0, math.nan], [1.0, 0.0]]}
    msg = _error(d)
    assert "measured.h2d_gbps[1]: expected a bandwidth in GB/s, a finite number >= 0 (0 = not measured)" in msg
    assert "measured.d2d_gbps[0][1]: expected" in msg
    d["measured"] = {"h2d_gbps": [12.0, 0.0, 12.0, math.inf]}
    assert "measured.h2d_gbps[3]: expected" in _error(d)
