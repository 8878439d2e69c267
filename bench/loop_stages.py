"""Per-stage time shares of RL steps (rollout, reward, old-logp, train, sync) and the wall time
of the whole `moe-rl train` command, measured on the default recipe.

    python bench/loop_stages.py                 # runs recipes/tiny_moe.yaml (30 steps)
    python bench/loop_stages.py --steps 8       # shorter
    python bench/loop_stages.py --run-dir DIR   # only summarize an existing run directory

Steps after the first are summarized (the first includes start-up compilation and caches).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "reward", "old_logp", "train", "sync")


def summarize(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    if not records:
        raise SystemExit(f"{run_dir}: need at least two steps")
    totals = {s: sum(r[f"time/{s}_s"] for r in records) for s in STAGES}
    step_total = sum(r["time/step_s"] for r in records)
    print(f"steps summarized: {len(records)}; mean step {step_total / len(records):.3f} s")
    for stage in STAGES:
        print(f"  {stage:9s} {totals[stage] / len(records):7.3f} s/step  {totals[stage] / step_total:6.1%}")
    other = step_total - sum(totals.values())
    print(f"  {'other':9s} {other / len(records):7.3f} s/step  {other / step_total:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="recipes/tiny_moe.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--run-dir", type=Path)
    args = parser.parse_args()
    if args.run_dir:
        summarize(args.run_dir)
        return
    out = Path(tempfile.mkdtemp(prefix="moe-rl-bench-"))
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "train",
            args.recipe,
            f"run.steps={args.steps}",
            f"run.output_dir={out}",
            "run.name=bench",
            "logging.progress=false",
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(f"moe-rl train {args.recipe} run.steps={args.steps}: {time.perf_counter() - start:.1f} s wall")
    summarize(out / "bench")


if __name__ == "__main__":
    main()
