#!/usr/bin/env bash
# Mutation testing of named modules (scripts/mutate.py, docs/testing.md):
#   scripts/mutate.sh moe_rl/trainer/returns.py [MODULE...] [-- tests/unit/x.py ...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ -x "$root/.venv/bin/cosmic-ray" ] || "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/python" "$root/scripts/mutate.py" "$@"
