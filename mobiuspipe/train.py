"""The torchrun entry, `torchrun --nproc_per_node N -m mobiuspipe.train --config RUN.yaml`: mobiuspipe.run.train."""

from mobiuspipe.run.train import entry, main

__all__ = ["entry", "main"]

if __name__ == "__main__":
    entry()
