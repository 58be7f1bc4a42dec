"""The topology package imports neither partition, mobiuspipe nor torch."""

import subprocess
import sys


def test_topology_imports_stay_inside():
    code = ("import sys, topology, topology.report, topology.report_svg, topology.layout, topology.presets\n"
            "import topology.discover, topology.sysfs, topology.nvml, topology.probe, topology.pci\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'partition', 'mobiuspipe', 'torch'})\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
