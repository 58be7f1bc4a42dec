"""The whole suite runs the CPU stand-ins as strict as CUDA and NCCL (mobiuspipe.standin); a test that needs the
lax ones sets MOBIUSPIPE_STRICT=0 itself. Set before any test starts a rank, which inherits it."""

import os

os.environ.setdefault("MOBIUSPIPE_STRICT", "1")
