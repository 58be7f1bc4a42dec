"""Where tensors live: the device arena, the host tier, and the ssd tier (SSDStore over the async I/O engine)."""

from mobiuspipe.memory.store.ssd_store import SSDStore, StoreFuture

__all__ = ["SSDStore", "StoreFuture"]
