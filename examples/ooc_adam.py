"""Out-of-core AdamW in a few lines: optimizer states on disk, a 64 MiB host budget, resume after a restart.

Run: .venv/bin/python examples/ooc_adam.py [FOLDER]   (default: a new temporary folder, removed at the end)
"""

from __future__ import annotations

import shutil
import sys
import tempfile

import torch

from foundation.timing import Stopwatch
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="mobiuspipe-ssd-")
    torch.manual_seed(0)
    params = {"embed": torch.randn(50_000, 256), "block0.w": torch.randn(1024, 4096), "head.b": torch.randn(7)}
    n = sum(p.numel() for p in params.values())
    with SSDStore(f"{folder}/job") as store:
        opt = OutOfCoreAdam.create(store, params, lr=1e-3, host_budget_bytes=64 << 20)
        print(
            f"{n / 1e6:.1f}M params -> {len(opt.groups)} groups of {opt.group_elems} elements, "
            f"{len(opt.slots)} slots in 64 MiB; I/O backend {store.engine.backend}, O_DIRECT {store.direct}"
        )
        bf16 = {k: torch.empty(p.shape, dtype=torch.bfloat16) for k, p in params.items()}
        for _ in range(3):
            grads = {k: torch.randn(p.shape).bfloat16() for k, p in params.items()}  # as offloaded by a GPU
            with Stopwatch() as sw:
                opt.step(grads, bf16)  # fp32 states stream through the budget; bf16 weights come out
            print(f"step {opt.step_count}: {sw.s:.3f} s, {2 * 12 * n / 1e9:.2f} GB read + written")
        opt.flush()  # states, checksums and the step count are durable from here
    with SSDStore(f"{folder}/job") as store:  # a new process would do the same
        opt = OutOfCoreAdam.open(store, host_budget_bytes=64 << 20)
        print(f"resumed at step {opt.step_count} with lr {opt.lr}; {len(store)} tensors in {store.folder}")
    if len(sys.argv) == 1:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
