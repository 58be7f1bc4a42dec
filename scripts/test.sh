#!/usr/bin/env bash
# Set up, then run the whole test suite. Extra arguments go to pytest (e.g. -k equivalence, -m "not slow").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
