"""The `colocated` tier of scripts/gpu_check.sh: the real Ray loop on this machine, trainer rank and
Megatron engine as separate processes sharing its GPU (`moe-rl train` on the tiny recipe), run twice
— memory given back between phases (`cluster.release_memory=on`) and kept (`off`) — and compared.

Prints one line per step: what the trainer keeps while the engine generates and after it trains,
its peak, the engine's generation footprint and what it keeps asleep; then the verdict:

* every RL step of the two runs is equal (rewards, losses, gradient norms, mismatch, sync bytes);
* each step the trainer released its memory once and the engine slept once;
* asleep, the engine keeps at most 10 % of its generation footprint; while the engine generates
  the trainer keeps less than it holds after training (its optimizer state and gradients are out);
* on CUDA the weights went from the trainer's GPU memory to the engine's by IPC handle
  (`sync/transport` = device_ipc), never through host memory.

    python scripts/colocated_check.py OUT_DIR [--device cuda] [--steps 4] [--level 1]

Exit status 0 when every check holds, 1 otherwise. With ``--device cpu`` it smoke-tests the tier on
a machine without a GPU (the memory is then the bytes of the tensors the phases move).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python scripts/colocated_check.py` from anywhere
ASLEEP_SHARE = 0.10
"""The most of its generation footprint an engine may keep while it sleeps."""


def train(out: Path, name: str, device: str, steps: int, level: int, release: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "launch.cli", "train", str(REPO / "recipes" / "tiny_moe.yaml"),
        f"run.name={name}", f"run.output_dir={out}", f"run.device={device}", f"run.steps={steps}",
        f"cluster.release_memory={release}", f"cluster.engine_sleep_level={level}",
        "logging.progress=false", "logging.tensorboard=false",
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"colocated_check: the {name} run failed (exit {done.returncode})")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def comparable(record: dict) -> dict:
    """What the two runs agree on: not times and rates, not memory (`metrics.repeatable`)."""
    from moe_rl.orchestration.metrics import repeatable

    return repeatable(record, ("memory/",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--level", type=int, default=1, choices=[1, 2])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    released = train(args.out, "released", args.device, args.steps, args.level, "on")
    kept = train(args.out, "kept", args.device, args.steps, args.level, "off")

    failures = []
    unit = "GiB" if args.device == "cuda" else "GiB (tensor bytes)"
    print(
        f"\nstep  trainer: generate / train / peak   engine: generate / asleep   ({unit}, level {args.level})"
    )
    for r in released:
        peak = r.get("memory/trainer_peak_gib", float("nan"))
        share = r["memory/engine_asleep_gib"] / max(r["memory/engine_generate_gib"], 1e-12)
        print(
            f"{r['step']:4d}  {r['memory/trainer_generate_gib']:8.3f} / {r['memory/trainer_train_gib']:6.3f} / "
            f"{peak:6.3f}   {r['memory/engine_generate_gib']:8.3f} / {r['memory/engine_asleep_gib']:6.3f} "
            f"({share:.1%} kept)"
        )
        if r["memory/trainer_releases"] != 1 or r["memory/engine_sleeps"] != 1:
            failures.append(
                f"step {r['step']}: released {r['memory/trainer_releases']}x, slept {r['memory/engine_sleeps']}x"
            )
        if share > ASLEEP_SHARE:
            failures.append(
                f"step {r['step']}: the engine kept {share:.1%} of its footprint asleep (> {ASLEEP_SHARE:.0%})"
            )
        if not r["memory/trainer_generate_gib"] < r["memory/trainer_train_gib"]:
            failures.append(f"step {r['step']}: the trainer released nothing for the generation")
        expected = "device_ipc" if args.device == "cuda" else "shared_memory"  # GPU to GPU on CUDA
        if r.get("sync/transport") != expected:
            failures.append(f"step {r['step']}: weights went by {r.get('sync/transport')}, not {expected}")
    for a, b in zip(released, kept, strict=True):
        if comparable(a) != comparable(b):
            keys = sorted(k for k in set(comparable(a)) | set(comparable(b)) if a.get(k) != b.get(k))
            failures.append(f"step {a['step']}: differs from the run that keeps its memory in {keys[:5]}")
    if len(released) != args.steps:
        failures.append(f"{len(released)} steps of {args.steps}")
    print()
    for failure in failures:
        print("FAIL:", failure)
    print(
        "colocated_check:", "PASS" if not failures else "FAIL", f"({len(released)} steps, level {args.level})"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
