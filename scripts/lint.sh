#!/usr/bin/env bash
# Lint: ruff (rules and formatting), pyright (basic mode) and clang-format over csrc/, at the versions
# pinned in pyproject.toml's dev extras, run from .venv (scripts/setup.sh installs them). Runs every check,
# names the fix of each that fails, and exits 1 if any did. Settings: pyproject.toml and .clang-format.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="$root/.venv/bin"
for tool in ruff pyright clang-format; do
    if [ ! -x "$bin/$tool" ]; then
        echo "[lint] $bin/$tool is missing: run scripts/setup.sh (it installs the dev extras)" >&2
        exit 2
    fi
done

failed=()
fail() {  # fail CHECK FIX: note a failed check and say how to fix it
    failed+=("$1")
    echo "[lint] $1 failed: $2" >&2
}

"$bin/ruff" check --quiet --output-format concise . \
    || fail "ruff check" "fix the findings above (\`.venv/bin/ruff check --fix\` fixes those marked [*]) and commit"

"$bin/ruff" format --check --quiet --output-format concise . \
    || fail "ruff format" "run \`.venv/bin/ruff format\` and commit"

# The pyright wheel bundles pyright and runs it on the nodejs wheel's node: no npm download, no system node.
# IGNORE_WARNINGS skips the wrapper's PyPI version check (a network call per run); were pyright ever
# fetched from npm (a forced version, which the unset variables rule out), it would go to .venv/.cache.
env -u PYRIGHT_PYTHON_FORCE_VERSION -u PYRIGHT_PYTHON_PYLANCE_VERSION PYRIGHT_PYTHON_IGNORE_WARNINGS=1 \
    PYRIGHT_PYTHON_CACHE_DIR="$root/.venv/.cache" "$bin/pyright" --warnings \
    || fail "pyright" "fix the type errors above and commit (\`.venv/bin/pyright FILE\` checks one file)"

mapfile -t sources < <(find csrc -name '*.cpp' -o -name '*.h' | sort)
"$bin/clang-format" --dry-run -Werror "${sources[@]}" \
    || fail "clang-format" "run \`.venv/bin/clang-format -i \$(find csrc -name '*.cpp' -o -name '*.h')\` and commit"

if [ ${#failed[@]} -gt 0 ]; then
    printf -v names '%s, ' "${failed[@]}"
    echo "[lint] FAILED: ${names%, }" >&2
    exit 1
fi
echo "[lint] ruff, pyright and clang-format: clean" >&2
