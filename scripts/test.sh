#!/usr/bin/env bash
# Set up, lint (scripts/lint.sh), then run the whole test suite. Extra arguments go to pytest (e.g. -k
# equivalence, -m "not slow"). The tests run even when lint fails, so one run reports both; either failing
# fails the run. They run in MOBIUSPIPE_TEST_WORKERS processes (pytest-xdist; default 2, 0: in
# pytest's own process).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
lint=0
"$root/scripts/lint.sh" || lint=$?
workers="${MOBIUSPIPE_TEST_WORKERS:-2}"
spread=()
if [ "$workers" != 0 ]; then
    if "$root/.venv/bin/python" -c "import xdist" 2>/dev/null; then
        spread=(-n "$workers")
    else  # a .venv on a preinstalled torch (MOBIUSPIPE_SYSTEM_TORCH=1) may lack the dev extras
        echo "[test] pytest-xdist is not installed: the tests run in one process" >&2
    fi
fi
"$root/.venv/bin/python" -m pytest -q "${spread[@]}" "$@" || exit $?
if [ "$lint" -ne 0 ]; then
    echo "[test] the tests passed, but lint failed (see [lint] above)" >&2
    exit "$lint"
fi
