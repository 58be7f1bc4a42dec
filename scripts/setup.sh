#!/usr/bin/env bash
# Idempotent set-up: .venv at the repo root, torch (CPU build 2.13.0 where no GPU exists), the project
# in editable mode with its dev extras, then the C++ extension (csrc/, optional: a failed build leaves the
# PyTorch fallback). Re-running it does nothing when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv" >&2
    "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

stamp="$venv/.mobiuspipe-setup"
want="$(cat pyproject.toml scripts/setup.sh mobiuspipe/_build.py $(find csrc -type f | sort) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$vpy" -c "import torch, mobiuspipe" 2>/dev/null; then
    exit 0
fi

pipq=("$vpy" -m pip install --quiet --disable-pip-version-check)
if ! "$vpy" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] NVIDIA GPU found: installing the CUDA build of torch" >&2
        "${pipq[@]}" "torch>=2.3,<=2.14.1"
    else
        echo "[setup] no GPU: installing torch 2.13.0 (CPU build)" >&2
        "${pipq[@]}" "torch==2.13.0" || "${pipq[@]}" "torch==2.13.0" \
            --index-url https://download.pytorch.org/whl/cpu
    fi
fi
echo "[setup] installing mobiuspipe (editable) and its dependencies" >&2
"${pipq[@]}" -e ".[dev]"
echo "[setup] building the C++ extension (mobiuspipe._C)" >&2
command -v ninja >/dev/null 2>&1 || [ -x "$venv/bin/ninja" ] || "${pipq[@]}" ninja \
    || echo "[setup] could not install ninja (torch.utils.cpp_extension needs it)" >&2
timeout 1800 "$vpy" -m mobiuspipe._build \
    || echo "[setup] C++ extension not built: using the PyTorch fallback" >&2
echo "$want" > "$stamp"
