"""The host-cores probe: one-thread processes computing at once, in units of one computing alone."""

import pytest

from topology import cpu_standin, load_topology, save_topology
from topology.probe_cpu import probe_host_cores
from topology.report import render_tree
from topology.types import Measured


@pytest.mark.slow
def test_host_cores_lie_between_one_and_the_workers():
    notes: list[str] = []
    c = probe_host_cores(notes, workers=2, repeats=1, iters=30)
    assert 1.0 <= c <= 2.0
    assert notes and "2 one-thread processes" in notes[0]


def test_host_cores_are_kept_in_layout_files_and_reported(tmp_path):
    import dataclasses

    t = dataclasses.replace(cpu_standin(2, 2**30), measured=Measured(host_cores=1.5))
    save_topology(t, tmp_path / "t.yaml")
    back = load_topology(tmp_path / "t.yaml")
    assert back.measured is not None and back.measured.host_cores == 1.5
    assert "host cores: 1.50" in render_tree(back)
