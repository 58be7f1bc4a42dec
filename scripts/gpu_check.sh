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
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec timeout 480 "$py" "$root/scripts/gpu_check.py" "$@"
