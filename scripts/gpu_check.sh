#!/usr/bin/env bash
# moe-rl's GPU checks, for a GPU machine without network (see docs/gpu.md).
#   scripts/gpu_check.sh [WHEEL_DIR]          # WHEEL_DIR defaults to .whl (scripts/fetch_gpu_wheels.sh)
# Installs the carried wheels into a scratch folder (nothing is installed system-wide), then runs
# the tiers below one after the other; a failing tier does not stop the others. Every step's full
# output goes to $GPU_CHECK_OUT (default gpu_check_logs/); one summary is printed at the end.
# Exit status: 0 when every tier that ran passed, 1 otherwise, 2 when the machine has no CUDA.
#
# Tiers (GPU_CHECK_TIERS, default "gpu unit diagnose bench"):
#   gpu       pytest -m gpu tests/unit tests/e2e    (CUDA variants of device-parametrized tests,
#                                                   other GPU tests; Ray / vLLM tests skip)
#   unit      pytest -m "not gpu" tests/unit -n 8   (the CPU unit suite, with pytest-xdist)
#   diagnose  moe-rl diagnose recipes/tiny_moe.yaml --quant bf16,fp8_block128,nvfp4 run.device=cuda
#   rl        RL steps of the tiny recipe on the GPU in one process (no Ray there): the trainer worker,
#             the Megatron engine and the bucket weight sync (python -m moe_rl.orchestration.local)
#   bench     bench/fp8_quant.py, bench/trainer_step.py --size mid, bench/algo_stack.py,
#             bench/engine_length.py (--device cuda)
#   colocated (not in the default list) the real Ray loop, trainer rank and Megatron engine as two
#             processes on the one GPU, with memory given back between phases and without; memory
#             per phase and the two runs compared (scripts/colocated_check.py). Needs Ray: the
#             pruned package scripts/fetch_gpu_wheels.sh writes (WHEEL_DIR/ray-pruned.tar.xz)
#
# Settings (environment):
#   GPU_CHECK_OUT            log folder (default gpu_check_logs)
#   GPU_CHECK_TIERS          tiers to run, space-separated (e.g. "gpu unit" then "diagnose bench"
#                            in a second call when one call may only run a few minutes)
#   GPU_CHECK_TIMEOUT        seconds allowed per step (default 0: no limit); a step past it fails
#   GPU_CHECK_PYTEST_ARGS    test selection replacing the default paths of both pytest tiers
#                            (e.g. "tests/unit/algo -k ksm"); the -m marker filter is kept
#   GPU_CHECK_WORKERS        pytest-xdist workers of the unit tier (default 8; 0: no xdist)
#   GPU_CHECK_GPU_WORKERS    pytest-xdist workers of the gpu tier, sharing the GPU (default 4; 0: none)
#   GPU_CHECK_PARALLEL       1 (default): the unit tier runs beside the gpu tier (the CPU suite barely
#                            touches the GPU); the steps after them start once both are done. 0: one
#                            after the other
#   GPU_CHECK_TRAINER_REPS   timed steps per worker of bench/trainer_step.py on CUDA (default 20)
#   GPU_CHECK_QUANT          diagnose's --quant list (default bf16,fp8_block128,nvfp4)
#   GPU_CHECK_DIAGNOSE_ARGS  extra diagnose arguments (e.g. "--prompts 8")
#   GPU_CHECK_BENCH_ARGS     extra arguments appended to every bench command (all four must accept them)
#   GPU_CHECK_BENCHES        the bench tier's scripts (default "fp8_quant trainer_step algo_stack
#                            engine_length"; trainer_step also runs its large size on CUDA)
#   GPU_CHECK_RL_STEPS       RL steps of the rl tier (default 8)
#   GPU_CHECK_COLOCATED_STEPS  RL steps of each run of the colocated tier (default 4)
#   GPU_CHECK_SLEEP_LEVEL    the engine's sleep level in the colocated tier (default 1)
#   GPU_CHECK_SKIP_INSTALL=1 use the current environment, install nothing (no WHEEL_DIR needed)
#   GPU_CHECK_ALLOW_CPU=1    run without CUDA, only to smoke-test this script on a CPU machine:
#                            tiers run on the CPU (diagnose run.device=cpu, benches --device cpu,
#                            trainer_step --size tiny --quick, algo_stack --quick, engine_length
#                            --quick); their results say nothing about the GPU path
#   PYTHON                   interpreter (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
wheel_dir="${1:-.whl}"
out="${GPU_CHECK_OUT:-gpu_check_logs}"
tiers="${GPU_CHECK_TIERS:-gpu unit diagnose rl bench}"
step_timeout="${GPU_CHECK_TIMEOUT:-0}"
workers="${GPU_CHECK_WORKERS:-8}"
gpu_workers="${GPU_CHECK_GPU_WORKERS:-4}"
quant="${GPU_CHECK_QUANT:-bf16,fp8_block128,nvfp4}"
python="${PYTHON:-python3}"
command -v "$python" >/dev/null || python=python

for tier in $tiers; do
  case "$tier" in
    gpu | unit | diagnose | rl | bench | colocated) ;;
    *)
      echo "gpu_check: unknown tier '$tier' in GPU_CHECK_TIERS (known: gpu unit diagnose rl bench colocated)" >&2
      exit 2
      ;;
  esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
rm -f "$out"/*.log "$out"/*.status
echo "gpu_check: logs in $out"

# ---- 1. the GPU -----------------------------------------------------------------------------
{
  if command -v nvidia-smi >/dev/null; then nvidia-smi || true; else echo "nvidia-smi: not found"; fi
} >"$out/nvidia-smi.log" 2>&1
cuda_probe='
import torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {ok}")
if ok:
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, "
          f"{torch.cuda.device_count()} device(s)")
'
if ! "$python" -c "$cuda_probe" >"$out/cuda.log" 2>&1; then
  cat "$out/cuda.log" >&2
  echo "gpu_check: cannot import torch with $python" >&2
  exit 2
fi
cat "$out/cuda.log"
if grep -q "cuda available: True" "$out/cuda.log"; then
  dev=cuda
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  dev=cpu
  echo "gpu_check: NO CUDA - GPU_CHECK_ALLOW_CPU=1: smoke-testing this script on the CPU;" \
    "the results say nothing about the GPU"
else
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False; see $out/nvidia-smi.log)." >&2
  echo "gpu_check: these checks need a GPU. (GPU_CHECK_ALLOW_CPU=1 only smoke-tests the script.)" >&2
  exit 2
fi

# ---- 2. the carried wheels ------------------------------------------------------------------
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  echo "gpu_check: GPU_CHECK_SKIP_INSTALL=1: using the current environment ($(command -v "$python"))"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
else
  shopt -s nullglob
  wheels=("$wheel_dir"/*.whl)
  shopt -u nullglob
  if [ "${#wheels[@]}" -eq 0 ]; then
    echo "gpu_check: no wheels in $wheel_dir: run scripts/fetch_gpu_wheels.sh on a machine with" \
      "network and carry the folder with the repository (or set GPU_CHECK_SKIP_INSTALL=1)" >&2
    exit 2
  fi
  echo "gpu_check: installing ${#wheels[@]} wheels from $wheel_dir into $tmp/site"
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "${wheels[@]}" \
    >"$out/install.log" 2>&1; then
    cat "$out/install.log" >&2
    echo "gpu_check: installing the wheels failed (log: $out/install.log)" >&2
    exit 2
  fi
  if [ -f "$wheel_dir/ray-pruned.tar.xz" ]; then # Ray without its unused parts (docs/gpu.md)
    xz -dc "$wheel_dir/ray-pruned.tar.xz" | tar -C "$tmp/site" -xf -
  fi
  export PYTHONPATH="$tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
env_probe='
import importlib
for name in ("megatron.core", "modelopt", "omegaconf", "pydantic", "math_verify", "transformers",
             "safetensors", "pyarrow", "ray", "moe_rl", "launch.cli"):
    try:
        mod = importlib.import_module(name)
        version = getattr(mod, "__version__", "")
        print(f"{name:14s} {version}")
    except Exception as exc:
        print(f"{name:14s} IMPORT FAILED: {type(exc).__name__}: {exc}")
'
"$python" -c "$env_probe" >"$out/env.log" 2>&1 || true
if grep -q "IMPORT FAILED" "$out/env.log"; then
  echo "gpu_check: some imports fail (the tiers that need them will fail):"
  grep "IMPORT FAILED" "$out/env.log" | sed 's/^/  /'
fi

# ---- 3. the tiers ---------------------------------------------------------------------------
limit=()
if [ "$step_timeout" != 0 ]; then limit=(timeout --kill-after=30 "$step_timeout"); fi

# run_step [--split] NAME CMD...: output to $out/NAME.log (with --split: stdout only, stderr to
# $out/NAME.err.log), exit status and seconds to $out/NAME.status. Never fails itself.
run_step() {
  local split=0
  if [ "$1" = --split ]; then
    split=1
    shift
  fi
  local name="$1"
  shift
  local log="$out/$name.log" err="$out/$name.log" start=$SECONDS rc=0
  [ "$split" = 1 ] && err="$out/$name.err.log"
  local cmd
  cmd="$(printf '%q ' "$@")"
  printf '$ %s\n' "$cmd" >"$log"
  [ "$split" = 1 ] && printf '$ %s\n' "$cmd" >"$err"
  printf '[%s] %s\n' "$name" "$cmd"
  "${limit[@]}" "$@" >>"$log" 2>>"$err" </dev/null || rc=$?
  echo "$rc $((SECONDS - start))" >"$out/$name.status"
  local verdict=ok
  [ "$rc" = 0 ] || verdict="FAILED (exit $rc)"
  [[ "$rc" = 5 && " $* " == *" -m pytest "* ]] && verdict="no tests selected (pytest exit 5)"
  if [ "$step_timeout" != 0 ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; }; then
    verdict="TIMEOUT after ${step_timeout}s"
  fi
  printf '[%s] %s in %ss (log: %s)\n' "$name" "$verdict" "$((SECONDS - start))" "$log"
}

# shellcheck disable=SC2206  # word splitting of the selection is intended
if [ -n "${GPU_CHECK_PYTEST_ARGS:-}" ]; then
  gpu_tests=($GPU_CHECK_PYTEST_ARGS)
  unit_tests=($GPU_CHECK_PYTEST_ARGS)
else
  gpu_tests=(tests/unit tests/e2e)
  unit_tests=(tests/unit)
fi
xdist=() gpu_xdist=()
if "$python" -c "import xdist" 2>/dev/null; then
  [ "$workers" != 0 ] && xdist=(-n "$workers")
  [ "$gpu_workers" != 0 ] && gpu_xdist=(-n "$gpu_workers")
else
  echo "gpu_check: pytest-xdist is not installed: the pytest tiers run in one process each"
fi
# shellcheck disable=SC2206
diagnose_extra=(${GPU_CHECK_DIAGNOSE_ARGS:-})
trainer_size=mid
[ "$dev" = cuda ] || trainer_size=tiny
# shellcheck disable=SC2206
bench_extra=(${GPU_CHECK_BENCH_ARGS:-})

# without CI: with CI=true the conftest fails skipped e2e tests (Ray / vLLM must skip here)
unit_tier() {
  run_step unit env -u CI "$python" -m pytest "${unit_tests[@]}" -m "not gpu" -q -p no:cacheprovider "${xdist[@]}"
}
unit_beside_gpu=0
if [ "${GPU_CHECK_PARALLEL:-1}" = 1 ] && [[ " $tiers " == *" gpu "* ]]; then unit_beside_gpu=1; fi
unit_pid=""
if [ "$unit_beside_gpu" = 1 ] && [[ " $tiers " == *" unit "* ]]; then
  unit_tier &
  unit_pid=$!
fi
ran=()
for tier in $tiers; do
  case "$tier" in
    gpu)
      run_step gpu env -u CI "$python" -m pytest -m gpu "${gpu_tests[@]}" -q -p no:cacheprovider "${gpu_xdist[@]}"
      ran+=(gpu)
      if [ -n "$unit_pid" ]; then
        wait "$unit_pid" || true # the steps after these two run on a quiet machine
        unit_pid=""
      fi
      ;;
    unit)
      [ "$unit_beside_gpu" = 1 ] || unit_tier # else it runs beside the gpu tier (started above)
      ran+=(unit)
      ;;
    diagnose)
      # the recipe's run.device is set to this machine's device so that diagnose runs on the GPU
      run_step --split diagnose "$python" -m launch.cli diagnose recipes/tiny_moe.yaml --quant "$quant" \
        "run.device=$dev" "${diagnose_extra[@]}"
      ran+=(diagnose)
      ;;
    rl)
      run_step --split rl "$python" -m moe_rl.orchestration.local --force-new recipes/tiny_moe.yaml \
        "run.device=$dev" "run.steps=${GPU_CHECK_RL_STEPS:-8}" "run.output_dir=${TMPDIR:-/tmp}/gpu_check_runs"
      ran+=(rl)
      ;;
    colocated)
      run_step colocated "$python" scripts/colocated_check.py "$out/colocated" --device "$dev" \
        --steps "${GPU_CHECK_COLOCATED_STEPS:-4}" --level "${GPU_CHECK_SLEEP_LEVEL:-1}"
      ran+=(colocated)
      ;;
    bench)
      for b in ${GPU_CHECK_BENCHES:-fp8_quant trainer_step algo_stack engine_length}; do
        args=(--device "$dev")
        [ "$b" = trainer_step ] && args+=(--size "$trainer_size")
        [ "$b" = trainer_step ] && [ "$dev" = cuda ] && args+=(--reps "${GPU_CHECK_TRAINER_REPS:-20}")
        if [ -n "${GPU_CHECK_BENCH_ARGS+set}" ]; then
          args+=("${bench_extra[@]}")
        elif [ "$dev" = cpu ] && [ "$b" != fp8_quant ]; then
          args+=(--quick) # CPU smoke test: small sizes (fp8_quant picks small CPU shapes itself)
        fi
        if [ -f "bench/$b.py" ]; then
          run_step "bench_$b" "$python" "bench/$b.py" "${args[@]}"
          if [ "$b" = trainer_step ] && [ "$dev" = cuda ] && [ -z "${GPU_CHECK_BENCH_ARGS+set}" ]; then
            # grouped against sequential experts on the larger model: two workers fit one GPU
            run_step bench_trainer_step_large "$python" bench/trainer_step.py --device cuda --size large \
              --variants seq,base --reps "${GPU_CHECK_TRAINER_REPS:-20}" --profile "${TMPDIR:-/tmp}/moe_rl_profile"
            ran+=(bench_trainer_step_large)
          fi
        else
          printf '$ %s\nbench/%s.py does not exist in this checkout\n' "bench/$b.py" "$b" >"$out/bench_$b.log"
          echo "127 0" >"$out/bench_$b.status"
          echo "[bench_$b] FAILED: bench/$b.py does not exist in this checkout"
        fi
        ran+=("bench_$b")
      done
      ;;
  esac
done

# ---- 4. the summary -------------------------------------------------------------------------
# pytest's last line, e.g. "2 failed, 130 passed, 12 skipped, 900 deselected in 81.20s"
pytest_counts() {
  local line
  line="$(grep -E '(^|[ =])[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)|no tests ran' "$1" |
    tail -n 1 | sed -E 's/^=+ *//; s/ *=+$//')"
  local n k counts=""
  for k in passed failed error skipped xfailed xpassed deselected; do
    n="$(grep -oE "[0-9]+ ${k}s?\b" <<<"$line" | grep -oE '^[0-9]+' || true)"
    counts+="$(printf '%s %-5s ' "$k" "${n:-0}")"
  done
  printf '%s\n' "$counts"
}

failed=0
echo
echo "=================================== gpu_check summary ==================================="
echo "machine: $(grep -E '^(torch|device 0)' "$out/cuda.log" | paste -sd ';' | sed 's/;/; /')"
[ "$dev" = cpu ] && echo "(GPU_CHECK_ALLOW_CPU=1 smoke test on the CPU: nothing here is a GPU result)"
for name in "${ran[@]}"; do
  read -r rc secs <"$out/$name.status"
  verdict=PASS note="" counts=""
  case "$name" in
    gpu | unit)
      counts="$(pytest_counts "$out/$name.log")"
      # pytest exits 5 when no test was selected (e.g. no GPU test in GPU_CHECK_PYTEST_ARGS)
      [ "$rc" = 5 ] && note="(no tests selected)"
      [ "$rc" = 0 ] || [ "$rc" = 5 ] || verdict=FAIL
      ;;
    *) [ "$rc" = 0 ] || verdict=FAIL ;;
  esac
  [ "$verdict" = PASS ] || failed=1
  [ "$rc" = 0 ] || [ -n "$note" ] || note="(exit $rc)"
  printf '%-20s %-4s %6ss  %s%s\n' "$name" "$verdict" "$secs" "$counts" "$note"
done
if [ -f "$out/diagnose.status" ]; then
  echo
  echo "--- diagnose: its tables (stdout: $out/diagnose.log; log lines: $out/diagnose.err.log) ---"
  sed '1d; /^[[:space:]]*$/d' "$out/diagnose.log" | tail -n 80
  read -r rc _ <"$out/diagnose.status"
  if [ "$rc" != 0 ]; then
    echo "diagnose failed (exit $rc); the end of its log:"
    tail -n 15 "$out/diagnose.err.log"
  fi
fi
if [ -f "$out/rl.status" ]; then
  echo
  echo "--- rl: one JSON line per step (reward, KL, grad norm, sync bytes) ---"
  "$python" - "$out/rl.log" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print(f"step {r['step']}: reward {r.get('reward/mean', 0):.3f} kl_k3 {r.get('old/kl_k3', 0):.2e} "
              f"grad_norm {r.get('train/grad_norm', 0):.3f} sync {r.get('sync/bytes', 0) / 1e6:.2f} MB "
              f"{r.get('time/step_s', 0):.2f} s")
PY
fi
if [ -f "$out/colocated.status" ]; then
  echo
  echo "--- colocated: memory per phase, the runs with and without memory given back compared ---"
  sed -n '/memory per phase/,$p' "$out/colocated.log" || true
fi
# the target lines of every bench, what trainer_step measured, algo_stack's size and ratio table
bench_re='target|TFLOP/s|seq/base|^fp8 block quant|^(tiny|mid|large) MoE|^memory:|^stack bench:|^ *(case|whole step|loss math|ESPO entropy)|^engine_length'
bench_lines=""
for name in "${ran[@]}"; do
  if [[ "$name" == bench_* ]]; then
    bench_lines+="$(grep -E "$bench_re" "$out/$name.log" || true)"$'\n'
  fi
done
bench_lines="$(sed '/^$/d' <<<"$bench_lines")"
if [ -n "$bench_lines" ]; then
  echo
  echo "--- bench targets (R3 overhead <= 3%, stack share <= 5%, FP8 quantizer >= 50% of copy bandwidth," \
    "KV-cached engine time(1024)/time(16) per token <= 1.3) ---"
  printf '%s\n' "$bench_lines"
fi
echo
if [ "$failed" = 0 ]; then
  echo "gpu_check: all ${#ran[@]} steps passed (logs: $out)"
else
  echo "gpu_check: FAILED steps above (logs: $out)"
fi
exit "$failed"
