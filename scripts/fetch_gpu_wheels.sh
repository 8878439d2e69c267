#!/usr/bin/env bash
# Download the wheels a GPU machine without network needs to run moe-rl's GPU checks
# (scripts/gpu_check.sh installs them there). Run it on any machine with network to PyPI; the
# wheels are for CPython 3.12 on manylinux x86_64, whatever the Python running this script.
# Idempotent: files already in DEST are kept, not downloaded again.
#   scripts/fetch_gpu_wheels.sh [DEST]        # DEST defaults to .whl (git-ignored)
# The GPU machine is expected to bring torch (CUDA), numpy, triton, transformers, safetensors,
# pyarrow, pytest (+ xdist, timeout) and hypothesis; these are the pure additions on top.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
py_version="${GPU_WHEELS_PYTHON:-3.12}"

wheels=(
  "megatron-core==0.16.1"
  "omegaconf==2.4.0"
  "antlr4-python3-runtime==4.13.2"
  "nvidia-modelopt==0.47.0"
  "pulp<4"
  "pydantic"
  "pydantic-core"
  "annotated-types"
  "typing-inspection"
  "typing_extensions>=4.16"
  "math-verify"
  "latex2sympy2_extended"
  "jsonschema"
  "jsonschema-specifications"
  "referencing"
  "rpds-py"
)
ray_version="2.60.0" # as the cpu and gpu extras pin it

python=python3
command -v "$python" >/dev/null || python=python
mkdir -p "$dest"
before="$(find "$dest" -maxdepth 1 -type f -name '*.whl' | sort)"

# --no-deps: the list above is the complete, tested set; resolving dependencies here would pull
# torch, nvidia-* and other wheels the GPU machine already has (several GB).
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$py_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "${wheels[@]}"

# Ray, pruned to what moe-rl runs (its Java, RLlib, Serve, Data, Tune, Train, AIR and workflow parts
# removed: ~25 MB instead of the 79 MB wheel), as one archive gpu_check.sh unpacks next to the wheels.
if [ ! -f "$dest/ray-pruned.tar.xz" ]; then
  ray_tmp="$(mktemp -d)"
  "$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$py_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$ray_tmp" "ray==$ray_version"
  mkdir "$ray_tmp/site"
  # unpacked with each file's mode: Ray's GCS server and raylet must stay executable
  "$python" - "$ray_tmp"/ray-*.whl "$ray_tmp/site" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
  (cd "$ray_tmp/site/ray" && rm -rf jars rllib serve data tune train air workflow util/dask)
  tar -C "$ray_tmp/site" -cf - . | xz -9 >"$dest/ray-pruned.tar.xz"
  rm -rf "$ray_tmp"
fi
echo "ray $ray_version, pruned: $(du -h "$dest/ray-pruned.tar.xz" | cut -f1) in $dest/ray-pruned.tar.xz"

after="$(find "$dest" -maxdepth 1 -type f -name '*.whl' | sort)"
new="$(comm -13 <(printf '%s\n' "$before") <(printf '%s\n' "$after") | sed '/^$/d')"
echo "wheels in $dest (python $py_version, manylinux x86_64):"
while IFS= read -r f; do
  [ -n "$f" ] || continue
  mark=" "
  grep -qxF "$f" <<<"$new" && mark="+"
  printf '  %s %8s  %s\n' "$mark" "$(du -h "$f" | cut -f1)" "$(basename "$f")"
done <<<"$after"
count="$(sed '/^$/d' <<<"$after" | wc -l)"
fetched="$(sed '/^$/d' <<<"$new" | wc -l)"
# shellcheck disable=SC2086  # word splitting of the file list is intended (names have no spaces)
total="$(du -ch $after | tail -1 | cut -f1)"
echo "fetched $fetched new (+), $count wheels in all, total $total"
