#!/usr/bin/env bash
# Create or update the project's virtual environment in .venv (idempotent: reinstalls only when
# pyproject.toml or the override file changed). CPU machines get the `cpu` and `dev` extras.
#   MOE_RL_EXTRAS=gpu,dev scripts/setup_env.sh     # on a GPU node
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${MOE_RL_EXTRAS:-cpu,dev}"
venv=.venv
stamp="$venv/.moe-rl-installed"
want="$(cat pyproject.toml constraints/cpu-overrides.txt | sha256sum | cut -d' ' -f1) $extras"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/moe-rl" ]; then
  exit 0
fi
echo "setting up $venv (extras: $extras)" >&2
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# uv resolves the whole set at once and honours the override file; pip installs torch first
# because its CPU build comes from pip's configured wheel folders, which uv does not read.
"$venv/bin/python" -m pip install --quiet --upgrade "pip>=24" "uv>=0.5"
if [[ ",$extras," == *",cpu,"* ]]; then
  "$venv/bin/python" -m pip install --quiet "torch==2.13.0"
fi
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
  --override constraints/cpu-overrides.txt -e ".[$extras]"
"$venv/bin/python" scripts/check_deps.py
echo "$want" > "$stamp"
