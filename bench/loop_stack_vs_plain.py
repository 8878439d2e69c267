"""Reward curves of the default fp8 recipe with the stability stack on and off, same seed.

    python bench/loop_stack_vs_plain.py [--steps 30]

"off" keeps the objective (ESPO) and turns the corrections off: no routing replay, no
keep-sampling-mask, no IcePop, no OPSM. Prints both curves and the mean reward of the last five
steps, whichever wins.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFF = [
    "algo.routing_replay=off",
    "algo.corrections.keep_sampling_mask=false",
    "algo.corrections.icepop.enabled=false",
    "algo.corrections.opsm.enabled=false",
]


def run(name: str, overrides: list[str], steps: int, out: Path) -> list[dict]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "train",
            "recipes/tiny_moe.yaml",
            f"run.steps={steps}",
            f"run.output_dir={out}",
            f"run.name={name}",
            "logging.progress=false",
            *overrides,
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="moe-rl-stack-"))
    for name, overrides in (("stack_on", []), ("stack_off", OFF)):
        records = run(name, overrides, args.steps, out)
        rewards = [r["reward/mean"] for r in records]
        kl = sum(r["old/kl_k3"] for r in records) / len(records)
        last = sum(rewards[-5:]) / 5
        print(
            f"{name:9s} last-5 reward {last:.3f}  mean KL k3 {kl:.2e}  curve "
            + " ".join(f"{x:.2f}" for x in rewards)
        )


if __name__ == "__main__":
    main()
