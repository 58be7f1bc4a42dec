#!/usr/bin/env bash
# Prove the CUDA paths in one run (scripts/gpu_check.py): equivalence against plain PyTorch under every activation
# policy and tier, overlap, memory against the plan, speed against its floor, the machine, and two ranks. On a
# CPU-only machine the same checks run on the strict stand-ins at a small size. Prints a table, writes
# gpu_check.json (or the path given with --out) and exits 1 if a check fails.
#
# The python: $PYTHON if set, else .venv/bin/python (scripts/setup.sh), else python3 (a GPU box whose CUDA PyTorch
# is preinstalled and has no network: run it from the repo root, nothing is installed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
cd "$root"
# cuBLAS reproducible from run to run (torch.use_deterministic_algorithms, which gpu_check.py turns on, needs it)
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
# The C++ extension (CPUAdam's SIMD kernel, O_DIRECT I/O): a GPU box with a preinstalled torch has none built for
# it; the PyTorch fallback's host Adam would bound the step. Build it (about a minute) unless told not to.
# (an extension built against another torch counts as none: mobiuspipe._ext refuses it)
usable='import sys, warnings; warnings.simplefilter("ignore"); from mobiuspipe import _ext; sys.exit(0 if _ext.HAVE_C else 1)'
if [ "${MOBIUSPIPE_NO_BUILD:-0}" != 1 ] && ! PYTHONPATH="$root" "$py" -c "$usable" 2>/dev/null; then
    PYTHONPATH="$root" timeout 300 "$py" -m mobiuspipe._build || echo "gpu_check: the C++ extension did not build; the PyTorch fallback runs"
fi
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec timeout 480 "$py" "$root/scripts/gpu_check.py" "$@"
