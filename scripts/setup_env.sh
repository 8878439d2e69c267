#!/usr/bin/env bash
# Create or update the project's virtual environment in .venv (idempotent: reinstalls only when
# pyproject.toml or the constraints changed). CPU machines get the `cpu` and `dev` extras.
#   MOE_RL_EXTRAS=gpu,dev scripts/setup_env.sh     # on a GPU node: the pinned stack of
#                                                  # constraints/gpu.txt (docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${MOE_RL_EXTRAS:-cpu,dev}"
venv=.venv
stamp="$venv/.moe-rl-installed"
want="$(cat pyproject.toml constraints/cpu-overrides.txt constraints/gpu.txt | sha256sum | cut -d' ' -f1) $extras bytecode"

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
if [[ ",$extras," == *",gpu,"* ]]; then
  pins=(--constraint constraints/gpu.txt)  # the pinned GPU stack
else
  pins=(--override constraints/cpu-overrides.txt)  # the CPU build's deliberate overrides
fi
# --compile-bytecode: every library's modules compiled once here. Without it each new process
# (every Ray worker, every `moe-rl` command) compiles Megatron-core, vLLM, Ray and transformers
# from source again where bytecode is not written (PYTHONDONTWRITEBYTECODE, read-only installs):
# `import megatron.core` took 7.0 s that way, 4.7 s compiled.
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "${pins[@]}" -e ".[$extras]"
"$venv/bin/python" scripts/check_deps.py "$extras"
echo "$want" > "$stamp"
