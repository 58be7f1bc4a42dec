"""The host probes of CPU runs: one-thread processes computing at once (in units of one computing alone), and gloo
messages between two processes."""

import pytest

from topology import cpu_standin, load_topology, save_topology
from topology.probe_cpu import MatmulWork, probe_host_cores, probe_messages
from topology.report import render_tree
from topology.types import Measured


def test_the_unit_of_work_computes_tanh_of_the_product_and_takes_time():
    import torch

    for seed in range(5):
        torch.manual_seed(seed)
        work = MatmulWork()
        assert work.seconds(3) > 0
        # an fp32 sum of 256 products of N(0, 1) values (sums ~16): its rounding reaches ~1e-5 near tanh's slope 1
        expected = torch.tanh(work.a.double() @ work.b.double()).float()
        torch.testing.assert_close(work.c, expected, rtol=0, atol=2e-4)


@pytest.mark.slow
def test_host_cores_lie_between_one_and_the_workers():
    notes: list[str] = []
    c = probe_host_cores(notes, workers=2, repeats=1, iters=30)
    assert 1.0 <= c <= 2.0
    assert notes and "2 one-thread processes" in notes[0]


@pytest.mark.slow
def test_messages_take_a_positive_latency_and_bandwidth():
    notes: list[str] = []
    latency, gbps = probe_messages(notes, repeats=5)
    assert 0 < latency < 1.0 and gbps > 0
    assert notes and "gloo" in notes[0]


def test_host_figures_are_kept_in_layout_files_and_reported(tmp_path):
    import dataclasses

    m = Measured(host_cores=1.5, message_latency_s=0.00025, message_gbps=2.5)
    t = dataclasses.replace(cpu_standin(2, 2**30), measured=m)
    save_topology(t, tmp_path / "t.yaml")
    back = load_topology(tmp_path / "t.yaml")
    assert back.measured == m
    assert "host cores: 1.50" in render_tree(back)
    assert "messages between ranks: 0.250 ms + bytes at 2.50 GB/s" in render_tree(back)
