#!/usr/bin/env bash
# Set up, lint (scripts/lint.sh), then run the whole test suite. Extra arguments go to pytest (e.g. -k
# equivalence, -m "not slow"). The tests run even when lint fails, so one run reports both; either failing
# fails the run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
lint=0
"$root/scripts/lint.sh" || lint=$?
"$root/.venv/bin/python" -m pytest -q "$@" || exit $?
if [ "$lint" -ne 0 ]; then
    echo "[test] the tests passed, but lint failed (see [lint] above)" >&2
    exit "$lint"
fi
