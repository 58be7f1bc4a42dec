"""read_nvml(): GPU names, memory, PCIe, NVLink, P2P status and common-ancestor levels from NVML, failing soft.

`nvml` is a pynvml-like module (default: the real `pynvml`, imported lazily); every NVML function is
called as an attribute of it, so a fake module replaces the whole library in tests. Failure handling:
- pynvml missing, or nvmlInit raising (LibraryNotFound, DriverNotLoaded, any NVMLError): available=False
  and one note; the caller falls back to sysfs.
- a field that raises (NotSupported, NoPermission, InvalidArgument, FunctionNotFound, Unknown, any other
  NVMLError, ctypes.ArgumentError): that field is unknown (0, "", -1 or "U"), one note per (field, error
  class) for the whole scan.
- traps avoided (reference A4): P2P READ is passed as a literal 0 (pynvml's NVML_P2P_CAPS_INDEX_READ is
  the tuple (0,)); the NVLink loop is bounded by the NVLINK_LINK_COUNT field, else by
  NVML_NVLINK_MAX_LINKS stopping at the first InvalidArgument; PCIe gen/width are the Max* values.
Bus ids are normalized to the sysfs form "0000:3b:00.0".
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from dataclasses import dataclass, replace

from foundation.units import fmt_spans
from topology.errors import TopologyError
from topology.pci import normalize_bus_id

__all__ = ["NvmlGpu", "NvmlScan", "read_nvml", "P2P_LABELS"]

P2P_LABELS = ("OK", "CNS", "GNS", "TNS", "DR", "NS", "U")
"""nvidia-smi topo -p2p labels of NVML_P2P_STATUS_* 0..6."""
_P2P_READ = 0
"""NVML_P2P_CAPS_INDEX_READ, as the int NVML wants (pynvml's constant is the tuple (0,))."""
_LINK_COUNT_FIELD = 91
"""NVML_FI_DEV_NVLINK_LINK_COUNT, used when the module does not define it."""
_MAX_LINKS = 36
"""NVML_NVLINK_MAX_LINKS in nvidia-ml-py >= 13, used when the module does not define it."""
_NO_LIBRARY = {"NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"}
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML reports it; 0 or "" = unknown."""

    index: int
    """NVML index (PCI bus order; ignores CUDA_VISIBLE_DEVICES)."""
    name: str
    uuid: str
    memory_bytes: int
    bus_id: str
    """Normalized: "0000:3b:00.0"."""
    max_gen: int
    """nvmlDeviceGetMaxPcieLinkGeneration: the most this GPU reaches in this slot."""
    max_width: int
    cpu_affinity: str
    """cpulist ("0-11,24-35")."""
    nvlinks: tuple[tuple[str, int], ...]
    """(remote bus id normalized, number of active links), sorted by remote."""


@dataclass(frozen=True)
class NvmlScan:
    """What NVML reports; matrices are indexed by position in `gpus`."""

    available: bool
    gpus: tuple[NvmlGpu, ...]
    p2p: tuple[tuple[str, ...], ...]
    """P2P read status labels (OK, CNS, GNS, TNS, DR, NS, U), "X" on the diagonal."""
    levels: tuple[tuple[int, ...], ...]
    """NVML_TOPOLOGY_* common-ancestor level (10 PIX ... 50 SYS), -1 unknown, 0 on the diagonal."""
    notes: tuple[str, ...]


class _Query:
    """Calls one NVML function at a time; an error leaves the field at its default and notes it once."""

    def __init__(self, nvml):
        self.nvml = nvml
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        found = (getattr(nvml, "NVMLError", None), mismatch)
        self.errors: tuple[type[BaseException], ...] = tuple(
            e for e in found if isinstance(e, type) and issubclass(e, BaseException)
        )
        self.errors += (ctypes.ArgumentError, UnicodeDecodeError)
        self.notes: dict[tuple[str, str], str] = {}

    def __call__(self, field: str, fn, *args, default):
        try:
            return fn(*args)
        except self.errors as e:
            self.note(field, e)
            return default

    def note(self, field: str, e: BaseException, what: str = "left unknown") -> None:
        self.notes.setdefault((field, type(e).__name__), f"NVML {field}: {type(e).__name__} ({e}); {what}")


def read_nvml(nvml=None) -> NvmlScan:
    """Scan every GPU NVML sees; never raises for a missing or partial NVML (see the module docstring)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:
            return _unavailable(
                f"NVML not available (pynvml not importable: {e}): using sysfs only; pip install nvidia-ml-py"
            )
    q = _Query(nvml)
    try:
        nvml.nvmlInit()
    except q.errors as e:
        return _unavailable(_init_note(e))
    try:
        scan = _scan(nvml, q)
    finally:
        closing = _shutdown(nvml, q)
    return replace(scan, notes=scan.notes + closing)


def _unavailable(note: str) -> NvmlScan:
    return NvmlScan(available=False, gpus=(), p2p=(), levels=(), notes=(note,))


def _init_note(e: BaseException) -> str:
    name = type(e).__name__
    why = f"{e}" if name in _NO_LIBRARY else f"{e}, {name}"
    return f"NVML not available ({why}): using sysfs only"


def _shutdown(nvml, q: _Query) -> tuple[str, ...]:
    try:
        nvml.nvmlShutdown()
    except q.errors as e:
        return (f"nvmlShutdown failed ({e}, {type(e).__name__}); the scan itself completed",)
    return ()


def _scan(nv, q: _Query) -> NvmlScan:
    try:
        count = nv.nvmlDeviceGetCount()
    except q.errors as e:
        return _unavailable(f"NVML not available (nvmlDeviceGetCount: {e}, {type(e).__name__}): using sysfs only")
    found = []
    for i in range(count):
        h = q("device handle", nv.nvmlDeviceGetHandleByIndex, i, default=None)
        bus = _bus_id(nv, q, h) if h is not None else ""
        if bus:
            found.append((i, h, bus))
        else:
            q.notes.setdefault(
                ("gpu", str(i)), f"NVML gpu {i}: no handle or PCI bus id; left out (sysfs may still list it)"
            )
    gpus = tuple(_gpu(nv, q, i, h, bus) for i, h, bus in found)
    handles = [h for _, h, _ in found]
    return NvmlScan(
        available=True,
        gpus=gpus,
        p2p=_p2p(nv, q, handles),
        levels=_levels(nv, q, handles),
        notes=tuple(q.notes.values()),
    )


def _bus_id(nv, q: _Query, h) -> str:
    info = q("PCI info", nv.nvmlDeviceGetPciInfo, h, default=None)
    if info is None:
        return ""
    try:
        return normalize_bus_id(_text(getattr(info, "busId", "")))
    except TopologyError as e:
        q.note("PCI bus id", e, "GPU left out")
        return ""


def _gpu(nv, q: _Query, i: int, h, bus: str) -> NvmlGpu:
    memory = q("memory info", nv.nvmlDeviceGetMemoryInfo, h, default=None)
    return NvmlGpu(
        index=i,
        name=_text(q("name", nv.nvmlDeviceGetName, h, default="")),
        uuid=_text(q("uuid", nv.nvmlDeviceGetUUID, h, default="")),
        memory_bytes=int(getattr(memory, "total", 0) or 0),
        bus_id=bus,
        max_gen=int(q("max PCIe link generation", nv.nvmlDeviceGetMaxPcieLinkGeneration, h, default=0)),
        max_width=int(q("max PCIe link width", nv.nvmlDeviceGetMaxPcieLinkWidth, h, default=0)),
        cpu_affinity=_cpu_affinity(nv, q, h),
        nvlinks=_nvlinks(nv, q, h),
    )


def _cpu_affinity(nv, q: _Query, h) -> str:
    words = -(-(os.cpu_count() or 1) // 64)
    mask = q("CPU affinity", nv.nvmlDeviceGetCpuAffinity, h, words, default=())
    return cpulist([int(w) for w in mask])


def cpulist(words: list[int]) -> str:
    """Bitmask words (bit i of word k = CPU 64k+i) -> "0-11,24-35"."""
    return fmt_spans((64 * k + b for k, w in enumerate(words) for b in range(64) if w >> b & 1), ",")


def _nvlinks(nv, q: _Query, h) -> tuple[tuple[str, int], ...]:
    """Active links per remote bus id. NotSupported (no NVLink) is normal and not noted."""
    count = _link_count(nv, q, h)
    bound = count if count is not None else int(getattr(nv, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS))
    per: Counter[str] = Counter()
    for link in range(bound):
        try:
            state = nv.nvmlDeviceGetNvLinkState(h, link)
        except q.errors as e:
            name = type(e).__name__
            if count is None and name == "NVMLError_InvalidArgument":
                break  # past this GPU's real link count
            if name != "NVMLError_NotSupported":
                q.note("NVLink state", e, "link skipped")
            continue
        if state == 1:  # NVML_FEATURE_ENABLED
            info = q("NVLink remote PCI info", nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link, default=None)
            remote = _remote_bus(info)
            if remote:
                per[remote] += 1
            else:
                q.notes.setdefault(
                    ("NVLink remote", ""),
                    "NVML NVLink remote end has no readable bus id "
                    "(an NVSwitch, or hidden in a VM): those links are not counted",
                )
    return tuple(sorted(per.items()))


def _link_count(nv, q: _Query, h) -> int | None:
    field = int(getattr(nv, "NVML_FI_DEV_NVLINK_LINK_COUNT", _LINK_COUNT_FIELD))
    values = q("NVLink link count", nv.nvmlDeviceGetFieldValues, h, [(field, 0)], default=None)
    if not values:
        return None
    v = values[0]
    if getattr(v, "nvmlReturn", 0) != 0:
        q.notes.setdefault(
            ("NVLink link count", "nvmlReturn"),
            f"NVML NVLink link count: field returned code {v.nvmlReturn}; probing links up to the first invalid index",
        )
        return None
    return int(getattr(v.value, _VALUE_MEMBER.get(getattr(v, "valueType", 1), "uiVal")))


def _remote_bus(info) -> str:
    """Bus id of an NVLink's remote end from the struct's ints (busId when they are absent); "" when the
    busId text is empty or unprintable, which NCCL reads as an NVSwitch not visible here."""
    text = _text(getattr(info, "busId", "")) if info is not None else ""
    if not text.strip() or not text.isprintable():
        return ""
    ints = [getattr(info, k, None) for k in ("domain", "bus", "device")]
    if all(isinstance(x, int) for x in ints):
        return f"{ints[0]:04x}:{ints[1]:02x}:{ints[2]:02x}.0"
    try:
        return normalize_bus_id(text)
    except TopologyError:
        return ""


def _p2p(nv, q: _Query, handles: list) -> tuple[tuple[str, ...], ...]:
    def status(a, b) -> str:
        # a literal 0 = READ: pynvml's NVML_P2P_CAPS_INDEX_READ is (0,) and ctypes rejects it
        s = q("P2P read status", nv.nvmlDeviceGetP2PStatus, a, b, _P2P_READ, default=None)
        return P2P_LABELS[s] if isinstance(s, int) and 0 <= s < len(P2P_LABELS) else "U"

    return tuple(tuple("X" if i == j else status(a, b) for j, b in enumerate(handles)) for i, a in enumerate(handles))


def _levels(nv, q: _Query, handles: list) -> tuple[tuple[int, ...], ...]:
    n = len(handles)
    lv = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            level = q(
                "topology common ancestor", nv.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j], default=-1
            )
            lv[i][j] = lv[j][i] = int(level)
    return tuple(tuple(row) for row in lv)


def _text(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x or "")
