"""PCIe facts: bus id normalization and link bandwidth from generation and width.

Bus ids: NVML prints "00000000:3B:00.0" (8-hex domain, upper case), sysfs and lspci "0000:3b:00.0";
mobiuspipe keeps the sysfs form everywhere. Bandwidths are one direction, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import re

from topology.errors import TopologyError

__all__ = ["normalize_bus_id", "pcie_gbps", "gen_from_speed", "LANE_GBPS"]

LANE_GBPS = {
    1: 2.5 * 0.8 / 8,
    2: 5.0 * 0.8 / 8,
    3: 8.0 * 128 / 130 / 8,
    4: 16.0 * 128 / 130 / 8,
    5: 32.0 * 128 / 130 / 8,
    6: 64.0 * 242 / 256 / 8,
}
"""Per-lane payload GB/s: transfer rate (GT/s) x line-code efficiency (8b/10b up to gen 2, 128b/130b for
gen 3-5, gen 6 FLIT mode 242/256) / 8 bits."""

_SPEED_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_BUS_RE = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_bus_id(text: str) -> str:
    """ "00000000:3B:00.0", "0000:3b:00.0" or "3b:00.0" -> "0000:3b:00.0"; TopologyError otherwise."""
    m = _BUS_RE.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise TopologyError(
            f"PCI bus id {text!r} is malformed; expected DOMAIN:BUS:DEVICE.FUNCTION "
            f"such as 0000:3b:00.0 or 00000000:3B:00.0"
        )
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def pcie_gbps(gen: int, width: int) -> float:
    """One-direction payload bandwidth of a PCIe link of generation `gen` and `width` lanes, GB/s."""
    if gen not in LANE_GBPS or width < 1:
        raise TopologyError(f"PCIe gen {gen} x{width} is not a link; expected gen 1-6 and width >= 1")
    return LANE_GBPS[gen] * width


def gen_from_speed(text: str) -> int:
    """PCIe generation from a sysfs speed string: "8.0 GT/s PCIe" (kernel > 5.6) or "8 GT/s"; 0 if unknown."""
    m = re.match(r"^\s*([0-9.]+)\s*GT/s", text or "")
    return _SPEED_GEN.get(float(m.group(1)), 0) if m else 0
