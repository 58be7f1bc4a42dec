"""How much a call raises this process's peak resident memory (Linux /proc), for the tests that bound the memory a
piece of the runtime takes beyond what it holds."""

from __future__ import annotations

from collections.abc import Callable

from mobiuspipe.run.usage import host_rss_bytes


def peak_growth_bytes(call: Callable[[], object]) -> int:
    """Bytes the peak resident size rose above the resident size before call() (run it once before, so that the
    allocator's first growth is not counted)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from now
    before = host_rss_bytes()
    call()
    with open("/proc/self/status") as f:
        peak_kib = int(f.read().split("VmHWM:")[1].split()[0])
    return peak_kib * 1024 - before
