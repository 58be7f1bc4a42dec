"""topology.probe: SSD bandwidth on a temporary file, its errors and O_DIRECT fallback, folding measurements in."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest

from topology import Topology, TopologyError, cpu_standin, preset
from topology import probe as probe_mod
from topology.layout import topology_from_dict
from topology.probe import NO_CUDA_NOTE, _cuda_devices, _fold_measured, probe
from topology.types import Measured

FAST = {"size_mb": 8, "repeats": 1}


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _measured(t: Topology) -> Measured:
    """What probe() measured (it always fills Topology.measured)."""
    assert t.measured is not None
    return t.measured


def test_importing_probe_does_not_import_torch():
    code = "import sys, topology.probe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_ssd_probe_measures_and_cleans_up(tmp_path):
    t = probe(cpu_standin(2, 2**30), tmp_path, size_mb=8, repeats=1)
    m = _measured(t)
    assert m.ssd_read_gbps > 0 and m.ssd_write_gbps > 0
    assert m.ssd_dir == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    if not _cuda():
        assert NO_CUDA_NOTE in m.notes
        assert (m.h2d_gbps, m.h2d_group_gbps, m.d2d_gbps) == ((), (), ())
        assert t.gpus == cpu_standin(2, 2**30).gpus  # nothing measured, nothing replaced


def test_no_ssd_dir_skips_the_ssd():
    m = _measured(probe(cpu_standin(1, 2**30), None, size_mb=8, repeats=1))
    assert (m.ssd_read_gbps, m.ssd_write_gbps, m.ssd_dir) == (0.0, 0.0, "")
    assert any("ssd_dir" in n for n in m.notes)


def test_missing_folder(tmp_path):
    folder = tmp_path / "nope"
    with pytest.raises(TopologyError, match="does not exist|nothing there") as e:
        probe(cpu_standin(1, 2**30), folder, size_mb=8, repeats=1)
    assert str(folder) in str(e.value) and "mkdir" in str(e.value)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(TopologyError, match="expected a directory, found a file") as e:
        probe(cpu_standin(1, 2**30), f, size_mb=8, repeats=1)
    assert str(f) in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(TopologyError, match="writable") as e:
            probe(cpu_standin(1, 2**30), folder, size_mb=8, repeats=1)
        assert str(folder) in str(e.value)
    finally:
        folder.chmod(0o700)


def test_unwritable_folder_even_as_root(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(TopologyError, match="expected a writable directory") as e:
        probe(cpu_standin(1, 2**30), tmp_path, size_mb=8, repeats=1)
    assert str(tmp_path) in str(e.value) and "chmod" in str(e.value)


def test_too_little_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**20, 5 * 2**20, 5 * 2**20))
    with pytest.raises(TopologyError, match="GiB free") as e:
        probe(cpu_standin(1, 2**30), tmp_path, size_mb=8, repeats=1)
    assert str(tmp_path) in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    if not probe_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & probe_mod._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    m = _measured(probe(cpu_standin(1, 2**30), tmp_path, size_mb=8, repeats=1))
    assert m.ssd_read_gbps > 0 and m.ssd_write_gbps > 0
    assert any("O_DIRECT" in n and "page cache" in n for n in m.notes)
    assert list(tmp_path.iterdir()) == []


def test_short_write_names_file_and_offset(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def short_write(fd, data):
        calls.append(1)
        return real_write(fd, data) if len(calls) <= 3 else 4096  # O_DIRECT check + 2 blocks, then short

    monkeypatch.setattr(os, "write", short_write)
    with pytest.raises(TopologyError, match=r"short write to .*probe.* at offset \d+: 4096 of .*errno") as e:
        probe(cpu_standin(1, 2**30), tmp_path, size_mb=8, repeats=1)
    assert str(tmp_path) in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_failing_write_names_errno(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(TopologyError, match=rf"offset \d+: errno {errno.ENOSPC}"):
        probe(cpu_standin(1, 2**30), tmp_path, size_mb=8, repeats=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw", [{"size_mb": 0}, {"repeats": 0}, {"size_mb": 1.5}])
def test_bad_arguments(tmp_path, kw):
    with pytest.raises(TopologyError, match="int >= 1"):
        probe(cpu_standin(1, 2**30), tmp_path, **{**FAST, **kw})


def test_fold_writes_measurements_into_links():
    t = preset("3+1")  # rc0: gpus 0-2 behind switch sw0; rc1: gpu 3
    m = Measured(
        h2d_gbps=(12.0, 12.5, 11.5, 13.0),
        h2d_group_gbps=(4.0, 4.5, 3.5, 12.9),
        d2d_gbps=tuple(tuple(0.0 if a == b else 9.0 for b in range(4)) for a in range(4)),
        matmul_tflops=(150.0, 151.0, 149.5, 150.5),
        ssd_dir="/x",
        ssd_read_gbps=3.2,
        ssd_write_gbps=2.1,
        notes=("n",),
    )
    f = _fold_measured(t, m)
    assert [g.link_gbps for g in f.gpus] == [12.0, 12.5, 11.5, 13.0]
    assert [r.uplink_gbps for r in f.root_complexes] == [pytest.approx(12.0), 12.9]
    assert f.switches == t.switches and f.measured == m
    assert f.load_gbps(0, 3) == pytest.approx(4.0)  # the group's measured aggregate, split three ways
    assert topology_from_dict(f.to_dict(), "x") == f


def test_fold_keeps_unmeasured_values():
    t = preset("2+2")
    f = _fold_measured(t, Measured(h2d_gbps=(10.0, 0.0, 0.0, 0.0), h2d_group_gbps=(5.0, 0.0, 6.0, 6.0)))
    assert [g.link_gbps for g in f.gpus] == [10.0] + [g.link_gbps for g in t.gpus[1:]]
    assert [r.uplink_gbps for r in f.root_complexes] == [t.root_complexes[0].uplink_gbps, 12.0]
    with pytest.raises(TopologyError, match="one per gpu"):
        _fold_measured(t, Measured(h2d_gbps=(1.0,)))
    with pytest.raises(TopologyError, match="measured.matmul_tflops has 1 values"):
        _fold_measured(t, Measured(matmul_tflops=(1.0,)))
    with pytest.raises(TopologyError, match="measured.matmul_fp32_tflops has 1 values"):
        _fold_measured(t, Measured(matmul_fp32_tflops=(1.0,)))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_matmul_rate_is_two_n_cubed_over_the_fastest_run(dtype):
    """On the CPU (the same function times a CUDA device with events): 2 n^3 FLOPs over the best of the repeats,
    against a timing of the same matmul here, within the machine's noise."""
    import time

    import torch

    rate = probe_mod.matmul_tflops(torch, "cpu", repeats=3, n=256, dtype=dtype)
    a = torch.randn(256, 256).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        torch.matmul(a, a)
        times.append(time.perf_counter() - start)
    assert 0.2 < rate / (2 * 256**3 / min(times[1:]) / 1e12) < 5


def _fake_torch(uuids):
    props = [SimpleNamespace(uuid=u) for u in uuids]
    cuda = SimpleNamespace(device_count=lambda: len(uuids), get_device_properties=lambda i: props[i])
    return SimpleNamespace(cuda=cuda)


def test_cuda_devices_by_uuid_index_or_given():
    t = preset("2+2")
    t = dataclasses.replace(t, gpus=tuple(dataclasses.replace(g, uuid=f"GPU-{g.index}aa") for g in t.gpus))
    notes = []
    assert _cuda_devices(_fake_torch(["3AA", "2aa", "1aa", "0aa"]), t, None, notes) == [3, 2, 1, 0]
    assert notes == []
    assert _cuda_devices(_fake_torch(["", "", "", ""]), t, None, notes) == [0, 1, 2, 3]
    assert len(notes) == 1 and "by index" not in notes[0] and "CUDA device i" in notes[0]
    assert _cuda_devices(_fake_torch(["a", "b", "c", "d"]), t, [1, 0, 3, 2], []) == [1, 0, 3, 2]
    with pytest.raises(TopologyError, match=r"UUIDs CUDA does not see.*CUDA_VISIBLE_DEVICES"):
        _cuda_devices(_fake_torch(["0aa", "1aa", "2aa", "9aa"]), t, None, [])
    with pytest.raises(TopologyError, match=r"expected 4 distinct CUDA devices in 0..3.*found \[0, 0, 1, 2\]"):
        _cuda_devices(_fake_torch(["a", "b", "c", "d"]), t, [0, 0, 1, 2], [])
    with pytest.raises(TopologyError, match="expected 4 distinct CUDA devices in 0..1"):
        _cuda_devices(_fake_torch(["", ""]), t, None, [])


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gpu_probe(tmp_path):
    import torch

    n = torch.cuda.device_count()
    t = cpu_standin(n, 2**30)
    f = probe(t, None, size_mb=8, repeats=1)
    m = _measured(f)
    assert len(m.h2d_gbps) == n and all(v > 0 for v in m.h2d_gbps)
    assert len(m.h2d_group_gbps) == n and all(v > 0 for v in m.h2d_group_gbps)
    assert all(m.d2d_gbps[a][a] == 0 and all(v > 0 for b, v in enumerate(m.d2d_gbps[a]) if b != a) for a in range(n))
    assert [g.link_gbps for g in f.gpus] == list(m.h2d_gbps)
    assert f.root_complexes[0].uplink_gbps == pytest.approx(sum(m.h2d_group_gbps))
    assert NO_CUDA_NOTE not in m.notes
    # the bf16 matmul rate: positive, and at most the datasheet's dense peak where the table lists the gpu
    from partition.spec.hardware import DEVICES

    assert len(m.matmul_tflops) == n and all(v > 1.0 for v in m.matmul_tflops)
    for i, rate in enumerate(m.matmul_tflops):
        listed = DEVICES.get(torch.cuda.get_device_name(i))
        assert listed is None or rate <= 1.05 * listed.peak_tflops, (rate, listed)


def test_probe_measures_host_adam_and_the_planner_uses_it(tmp_path):
    import dataclasses

    from partition.search import HOST_ADAM_PARAMS_PER_S, host_adam_rate
    from topology import preset
    from topology.probe_cpu import probe_host_adam

    notes: list[str] = []
    rate = probe_host_adam(notes, params=200_000, repeats=1)
    assert rate > 0 and "torch.optim.AdamW" in notes[0]
    t = preset("2+2")
    assert host_adam_rate(t) == HOST_ADAM_PARAMS_PER_S
    measured = dataclasses.replace(t, measured=Measured(host_adam_params_per_s=rate))
    assert host_adam_rate(measured) == rate


def test_the_fp32_matmul_is_timed_without_tf32_and_the_setting_restored():
    """torch's new API (the legacy allow_tf32 refuses to be read once the two were mixed); the flag is global, so the
    CPU can check it."""
    import torch

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with probe_mod.ieee_matmuls(torch):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before


def test_a_gpus_matmul_rate_is_the_one_it_sustains():
    """On CUDA the rate is the median of runs of back-to-back products after a warm-up, each run at least
    SUSTAIN_S[1] of gpu time: a gpu that runs its first products at a boost clock (1 ms each here) and then settles
    at its power limit (1.25 ms) is measured at the settled rate, where the best single product would say 25% more."""
    clock = [0.0]
    made = [0]

    def matmul(a, b):
        made[0] += 1
        clock[0] += 1e-3 if made[0] <= 50 else 1.25e-3

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # ms, as CUDA's

    cuda = SimpleNamespace(Event=Event, device=lambda d: contextlib.nullcontext())
    fake = SimpleNamespace(cuda=cuda, matmul=matmul)
    n = 1000
    rate = probe_mod._sustained_rate(fake, "cuda:0", None, None, repeats=3, n=n)
    assert rate == pytest.approx(2 * n**3 / 1.25e-3 / 1e12)
    assert clock[0] >= probe_mod.SUSTAIN_S[0] + 3 * probe_mod.SUSTAIN_S[1]  # warmed up, then three long runs
