#!/usr/bin/env bash
# Idempotent set-up: .venv at the repo root, torch (CPU build 2.13.0 where no GPU exists; the CUDA build where
# one does, replacing a CPU torch an earlier set-up left in .venv), the project in editable mode with its dev
# extras, then the C++ extension (csrc/, optional: a failed build leaves the PyTorch fallback). Re-running it
# does nothing when nothing changed.
#
# MOBIUSPIPE_SYSTEM_TORCH=1: a GPU server with no network whose python3 already has a CUDA PyTorch (and the
# project's other dependencies): .venv sees that python's packages (--system-site-packages), nothing is
# downloaded, and the project is installed without its dependencies; a missing one is named.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

system="${MOBIUSPIPE_SYSTEM_TORCH:-0}"
# The torch releases this project runs on (pyproject.toml's requirement; a test keeps the two equal): 2.10 is the
# oldest whose suite passes (the pinned torchao 0.18 needs F.ScalingType, absent up to 2.9; transformers 5.x turns
# itself off below 2.6); checked on 2.10.0, 2.11.0 and 2.13.0.
torch_spec="torch>=2.10,<=2.14.1"
# What a set-up installs where none is there yet: the release the test suite runs on (on a GPU server PyPI's
# default build of it, a CUDA build whose driver needs say_torch checks), not the newest in the range.
torch_pin="torch==2.13.0"
made=0
if [ ! -x "$venv/bin/python" ]; then
    made=1
    echo "[setup] creating $venv" >&2
    if [ "$system" = "1" ]; then "$py" -m venv --system-site-packages "$venv"; else "$py" -m venv "$venv"; fi
fi
vpy="$venv/bin/python"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# venv_sees_system VENV: whether VENV was made with --system-site-packages (its pyvenv.cfg says so)
venv_sees_system() { grep -qiE '^include-system-site-packages *= *true' "$1/pyvenv.cfg" 2>/dev/null; }
# say_torch: the torch .venv runs, and on a GPU server whether it can use the GPU (a loud line when it cannot)
say_torch() {
    "$vpy" -c "import torch; print(f'[setup] torch {torch.__version__}, CUDA {torch.version.cuda}')" >&2
    if has_gpu && ! "$vpy" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        echo "[setup] WARNING: an NVIDIA GPU is here but this torch cannot use it (a CPU build, or a driver older than" \
            "its CUDA: nvidia-smi shows the driver's); runs would train on CPU stand-ins and scripts/gpu_check.sh" \
            "fails its first check" >&2
    fi
}
cpu_torch_on_gpu() { has_gpu && "$vpy" -c "import torch, sys; sys.exit(torch.version.cuda is not None)" 2>/dev/null; }
# torch_in_range SPEC: whether the venv's torch is within SPEC ("torch>=A,<=B"); says why not on stderr
torch_in_range() {
    "$vpy" - "$1" <<'PY'
import re, sys
import torch
spec = sys.argv[1]
have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
for op, v in re.findall(r"(>=|<=)([\d.]+)", spec):
    want = tuple(int(x) for x in v.split("."))
    if not (have[: len(want)] >= want if op == ">=" else have[: len(want)] <= want):
        print(f"[setup] torch {torch.__version__} is outside {spec}, the releases this project runs on", file=sys.stderr)
        sys.exit(1)
PY
}

if [ "$system" = "1" ]; then
    if [ "$made" = 0 ] && ! venv_sees_system "$venv"; then
        echo "[setup] MOBIUSPIPE_SYSTEM_TORCH=1, but $venv was made by an earlier set-up without the system's" \
            "packages, so it cannot see $py's torch: remove it (rm -rf .venv) and run this again" >&2
        exit 2
    fi
    if ! "$vpy" -c "import torch" 2>/dev/null; then
        echo "[setup] MOBIUSPIPE_SYSTEM_TORCH=1, but $py has no torch: run with the python that has it (PYTHON=...)" >&2
        exit 2
    fi
    if ! torch_in_range "$torch_spec"; then
        echo "[setup] use a python whose torch is in that range (PYTHON=...), or set up without MOBIUSPIPE_SYSTEM_TORCH, which installs one" >&2
        exit 2
    fi
    if ! "$vpy" -c "import setuptools, wheel" 2>/dev/null; then
        echo "[setup] installing the project offline needs setuptools (64 or newer) and wheel in $py, which has" \
            "none: add them (python3 -m pip install setuptools wheel, or the system's python3-setuptools and" \
            "python3-wheel packages), or carry their wheels" >&2
        exit 2
    fi
    "$vpy" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-index -e . \
        || { echo "[setup] could not install the project offline (pip install -e . --no-deps)" >&2; exit 2; }
    missing="$("$vpy" -c "
import importlib.util as u
names = {'numpy': 'numpy', 'yaml': 'pyyaml', 'transformers': 'transformers', 'safetensors': 'safetensors',
         'tokenizers': 'tokenizers', 'tensorboard': 'tensorboard', 'matplotlib': 'matplotlib', 'pynvml': 'nvidia-ml-py',
         'datasets': 'datasets', 'torchao': 'torchao', 'highspy': 'highspy'}
print(' '.join(p for m, p in names.items() if u.find_spec(m) is None))")"
    [ -z "$missing" ] || echo "[setup] missing packages (carry their wheels; highspy: the open MIP solver, the" \
        "planner falls back to its exact DP without it): $missing" >&2
    tests="$("$vpy" -c "
import importlib.util as u
print(' '.join(p for p in ('pytest', 'pytest_timeout', 'hypothesis', 'peft') if u.find_spec(p) is None))")"
    [ -z "$tests" ] || echo "[setup] for the tests (scripts/gpu_check.sh runs the gpu-marked ones), missing: $tests" >&2
    timeout 1800 "$vpy" -m mobiuspipe._build || echo "[setup] C++ extension not built: using the PyTorch fallback" >&2
    say_torch
    exit 0
fi

stamp="$venv/.mobiuspipe-setup"
want="$(cat pyproject.toml scripts/setup.sh mobiuspipe/_build.py $(find csrc -type f | sort) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$vpy" -c "import torch, mobiuspipe" 2>/dev/null \
    && ! cpu_torch_on_gpu; then
    exit 0
fi

pipq=("$vpy" -m pip install --quiet --disable-pip-version-check)
if cpu_torch_on_gpu; then
    echo "[setup] NVIDIA GPU found, but .venv holds a CPU build of torch: installing the CUDA build over it" >&2
    "${pipq[@]}" --force-reinstall "$torch_pin"
elif ! "$vpy" -c "import torch" 2>/dev/null; then
    if has_gpu; then
        echo "[setup] NVIDIA GPU found: installing the CUDA build of torch" >&2
        "${pipq[@]}" "$torch_pin"
    else
        echo "[setup] no GPU: installing $torch_pin (CPU build)" >&2
        "${pipq[@]}" "$torch_pin" || "${pipq[@]}" "$torch_pin" \
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
say_torch
echo "$want" > "$stamp"
