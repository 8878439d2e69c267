"""LoRA against full-weight training on the tiny task: the steps to reward 0.5, several seeds.

    python bench/lora_learning.py --write docs/lora_learning.md   # runs + report
    python bench/lora_learning.py --seeds 1 --steps 3             # smoke, report to stdout

Each arm is `recipes/tiny_moe.yaml` with overrides (`ARMS`): ``full`` as it is (every weight
trains), ``lora8`` with adapters of rank 8 (`lora.rank=8`, `lora.alpha=16`, every target: attention,
every expert; the base frozen) and the output layer trained whole (`lora.train_output_layer=true`:
the tiny model starts from random weights, and a random frozen head bounds its logits), and
``lora8_frozen_head`` the same adapters with the head frozen too. Every run is a subprocess running the loop of `moe-rl train` in one
process without Ray (`moe_rl.orchestration.local`: one trainer rank, one Megatron engine that
samples from the merged weights the sync sends), `--jobs` at a time, in `--out/<arm>-seed<k>`; a run
whose metrics.jsonl holds every step is reused.

The report gives per arm and seed the first step at which reward/mean ≥ 0.5, the mean reward of the
last 5 steps and the trainable parameters, then LoRA's steps over the full run's, seed by seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import advantage_estimators as ae  # noqa: E402  (its metrics reader and threshold step)

DEFAULT_OUT = REPO / "bench" / "results" / "lora_learning"
RECIPE = "recipes/tiny_moe.yaml"
STEPS = 60
COMMAND = "python bench/lora_learning.py --write docs/lora_learning.md"
ARMS = {
    "full": (),
    "lora8": ("lora.rank=8", "lora.alpha=16", "lora.train_output_layer=true"),
    "lora8_frozen_head": ("lora.rank=8", "lora.alpha=16"),
}
LABELS = {
    "full": "full weights",
    "lora8": "LoRA rank 8 (alpha 16), output layer trained",
    "lora8_frozen_head": "LoRA rank 8 (alpha 16), output layer frozen",
}


def train(arm: str, seed: int, steps: int, out: Path, jobs: int) -> Path:
    """Run one arm and seed in a subprocess (`run_one`) unless a finished run is there."""
    return ae.spawn_run(__file__, arm, seed, steps, out, jobs)


def run_one(arm: str, seed: int, steps: int, run_dir: Path) -> None:
    """One run in this process (`moe_rl.orchestration.local`); records to `run_dir/metrics.jsonl`,
    the trainable parameter count to `run_dir/trainable.json`."""
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    config = load_checked(
        RECIPE, [*ARMS[arm], f"run.seed={seed}", f"run.steps={steps}", "logging.progress=false"]
    )
    setup_logging(config.logging.level)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    run = LocalRun(config)
    model = run.trainer.worker.model
    counts = {
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in model.parameters()),
    }
    (run_dir / "trainable.json").write_text(json.dumps(counts))
    with open(run_dir / "metrics.jsonl", "w") as metrics:
        for record in run.run():
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()


def report(out: Path, seeds: list[int], steps: int) -> str:
    lines = [
        "# LoRA against full-weight training on the tiny task",
        "",
        f"Regenerate: `{COMMAND}` (runs in `bench/results/lora_learning/`; the module docstring of "
        "`bench/lora_learning.py` says what each arm is). "
        f"{steps} steps of 64 samples (8 prompts × groups of 8), the tiny recipe's stack, seeds "
        f"{', '.join(map(str, seeds))}; the in-process loop (one trainer rank, the Megatron engine, the "
        "sync of the merged weights between them).",
        "",
        f"| arm | seed | trainable / total parameters | first step reward ≥ {ae.THRESHOLD} | "
        f"final reward (last {ae.WINDOW} steps) |",
        "|---|---|---|---|---|",
    ]
    first: dict[tuple[str, int], int | None] = {}
    for arm in ARMS:
        for seed in seeds:
            run_dir = out / f"{arm}-seed{seed}"
            records = ae.read_metrics(run_dir)
            if not records:
                continue
            rewards = [r["reward/mean"] for r in records]
            counts = json.loads((run_dir / "trainable.json").read_text())
            first[arm, seed] = ae.first_step(rewards)
            final = sum(rewards[-ae.WINDOW :]) / len(rewards[-ae.WINDOW :])
            lines.append(
                f"| {LABELS[arm]} | {seed} | {counts['trainable']:,} / {counts['total']:,} | "
                f"{first[arm, seed] if first[arm, seed] is not None else 'not reached'} | {final:.3f} |"
            )
    lines += ["", "LoRA's first step at reward ≥ 0.5 over the full run's (target: at most 2):", ""]
    for seed in seeds:
        full, lora = first.get(("full", seed)), first.get(("lora8", seed))
        ratio = f"{lora / full:.2f}" if full and lora else "–"
        lines.append(
            f"- seed {seed}: {lora if lora else 'not reached'} / {full if full else 'not reached'} = {ratio}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated run.seed values")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run directories")
    parser.add_argument("--report-only", action="store_true", help="no runs: report what --out holds")
    parser.add_argument("--write", type=Path, help="write the markdown report here (else stdout)")
    parser.add_argument("--run-one", nargs=4, metavar=("ARM", "SEED", "STEPS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        arm, seed, steps, run_dir = args.run_one
        run_one(arm, int(seed), int(steps), Path(run_dir))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        jobs = [(arm, seed) for seed in seeds for arm in ARMS]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: train(*job, args.steps, args.out, args.jobs), jobs))
    text = report(args.out, seeds, args.steps)
    if args.write:
        args.write.write_text(text)
        print(f"wrote {args.write}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
