#!/usr/bin/env bash
# Set up, then run the main job (examples/tiny-gpt.yaml): a tiny byte-level GPT trained by the Mobius pipeline,
# the stages and microbatches the planner picks, on 2 ranks (CPU stand-ins where there is no GPU). Extra arguments go
# to `mobiuspipe train`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/mobiuspipe" train --config "$root/examples/tiny-gpt.yaml" "$@"
