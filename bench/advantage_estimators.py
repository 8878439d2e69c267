"""GRPO, PPO with a critic and REINFORCE++ on the tiny task, same samples per step, several seeds.

    python bench/advantage_estimators.py --write docs/advantage_estimators.md   # runs + report
    python bench/advantage_estimators.py --seeds 1 --steps 3                    # smoke, report to stdout

Each estimator is a recipe and overrides (`ESTIMATORS`): GRPO is `recipes/tiny_moe.yaml` as it is
(8 prompts × groups of 8), PPO is `recipes/tiny_moe_ppo.yaml` (64 prompts, one response each, GAE
with a critic), REINFORCE++ is `recipes/tiny_moe.yaml` with `algo.advantage=reinforce_pp` and
`rollout.group_size=1` (64 prompts, one response each). Every run is a subprocess running the loop
of `moe-rl train` in one process without Ray (`moe_rl.orchestration.local`: one trainer rank, one
Megatron engine; Ray's start times out on a loaded machine), `--jobs` at a time with cores / jobs
threads each, in `--out/<estimator>-seed<k>`; a run whose metrics.jsonl holds every step is reused,
so an interrupted bench continues where it stopped.

The report gives per estimator and seed the first step at which reward/mean ≥ 0.5, the mean reward
of the last 5 steps and the mean reward of every 5 steps. REINFORCE++ runs dump their trajectories
(`logging.dump_trajectories=true`); with γ = 1 and no KL in the reward, each response's raw token
advantage is its reward on every one of its tokens, so per step
advantage/token_mean_raw = Σ L_i R_i / Σ L_i and advantage/token_std_raw is the unbiased std of
each R_i repeated L_i times (L_i the response's length); the report gives the largest difference
of the logged values from these.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/advantage_estimators.py` from anywhere

DEFAULT_OUT = REPO / "bench" / "results" / "advantage_estimators"
STEPS = 30
THRESHOLD = 0.5
WINDOW = 5
COMMAND = "python bench/advantage_estimators.py --write docs/advantage_estimators.md"

ESTIMATORS = {
    "grpo": ("recipes/tiny_moe.yaml", ()),
    "ppo": ("recipes/tiny_moe_ppo.yaml", ()),
    "reinforce_pp": (
        "recipes/tiny_moe.yaml",
        ("algo.advantage=reinforce_pp", "rollout.group_size=1", "logging.dump_trajectories=true"),
    ),
}
LABELS = {
    "grpo": "GRPO (8 prompts × group 8)",
    "ppo": "PPO + critic, GAE (64 prompts × 1)",
    "reinforce_pp": "REINFORCE++ (64 prompts × 1)",
}


# ------------------------------------------------------------------------------------ runs
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(estimator: str, seed: int, steps: int, out: Path, jobs: int) -> Path:
    """Run one estimator and seed (a subprocess: `run_one`) unless a finished run is there; return
    its run directory."""
    return spawn_run(__file__, estimator, seed, steps, out, jobs)


def spawn_run(script: str, arm: str, seed: int, steps: int, out: Path, jobs: int) -> Path:
    """``script --run-one arm seed steps DIR`` in a subprocess with one share of the cores, unless
    `out/<arm>-seed<seed>` holds every step already; its run directory."""
    name = f"{arm}-seed{seed}"
    run_dir = out / name
    if len(read_metrics(run_dir)) >= steps:
        return run_dir
    threads = str(max(1, (os.cpu_count() or 1) // jobs))  # one share of the cores per concurrent run
    env = {
        **os.environ,
        **{k: threads for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
    }
    command = [sys.executable, script, "--run-one", arm, str(seed), str(steps), str(run_dir)]
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{name} failed (exit {code}); see {out / (name + '.log')}")
    return run_dir


def run_one(estimator: str, seed: int, steps: int, run_dir: Path) -> None:
    """One run in this process: the loop of `moe-rl train` with one trainer rank and the Megatron
    engine, without Ray (`moe_rl.orchestration.local`); each step's record goes to
    `run_dir/metrics.jsonl`, dumped trajectories to `run_dir/trajectories/`."""
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    recipe, overrides = ESTIMATORS[estimator]
    config = load_checked(
        recipe, [*overrides, f"run.seed={seed}", f"run.steps={steps}", "logging.progress=false"]
    )
    setup_logging(config.logging.level)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    run = LocalRun(config)
    run.stages.run_dir = run_dir  # where the step's trajectory shards go (the loop writes nothing else)
    with open(run_dir / "metrics.jsonl", "w") as metrics:
        for record in run.run():
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()


# ------------------------------------------------------------------------------ hand check
def step_responses(run_dir: Path) -> dict[int, list[tuple[int, float]]]:
    """Per step, (length, reward) of each response in the run's dumped trajectories
    (`trajectories/step_<step>/`, one shard folder per step)."""
    from moe_rl.data.shards import read_shards, trajectory_folders

    found: dict[int, list[tuple[int, float]]] = {}
    for folder in trajectory_folders(run_dir / "trajectories"):
        step = int(folder.name.removeprefix("step_"))
        for batch in read_shards(folder, include_old_logp=False):
            lengths = batch.response_offsets.diff().tolist()
            found.setdefault(step, []).extend(zip(lengths, batch.rewards.double().tolist()))
    return found


def hand_stats(responses: list[tuple[int, float]]) -> tuple[float, float]:
    """Mean and unbiased std over tokens of each response's reward repeated over its tokens."""
    n = sum(length for length, _ in responses)
    mean = sum(length * reward for length, reward in responses) / n
    var = sum(length * (reward - mean) ** 2 for length, reward in responses) / (n - 1)
    return mean, math.sqrt(var)


def hand_check(run_dir: Path) -> tuple[int, float, float, float, float]:
    """(steps checked, then the largest |logged − hand| and |logged − hand| / |hand| of
    token_mean_raw, then of token_std_raw); no steps when the run dumped no trajectories."""
    rows = {int(r["step"]): r for r in read_metrics(run_dir)}
    worst = [0.0] * 4
    checked = 0
    responses = step_responses(run_dir) if (run_dir / "trajectories").is_dir() else {}
    for step in sorted(set(responses) & set(rows)):
        hand = hand_stats(responses[step])
        logged = rows[step]["advantage/token_mean_raw"], rows[step]["advantage/token_std_raw"]
        for k, (x, y) in enumerate(zip(logged, hand)):
            worst[2 * k] = max(worst[2 * k], abs(x - y))
            worst[2 * k + 1] = max(worst[2 * k + 1], abs(x - y) / max(abs(y), 1e-12))
        checked += 1
    return checked, *worst


# ---------------------------------------------------------------------------------- report
def first_step(rewards: list[float]) -> int | None:
    return next((i for i, r in enumerate(rewards) if r >= THRESHOLD), None)


def report(out: Path, seeds: list[int], steps: int) -> str:
    lines = [
        "# Advantage estimators on the tiny task: GRPO, PPO with a critic, REINFORCE++",
        "",
        f"Regenerate: `{COMMAND}` (runs in `bench/results/advantage_estimators/`, reused when finished).",
        "",
        f"The tiny MoE and task of `recipes/tiny_moe.yaml`, {steps} steps of 64 samples each, seeds "
        f"{', '.join(map(str, seeds))} (`run.seed`). GRPO is that recipe as it is (8 prompts × groups of 8); PPO "
        "is `recipes/tiny_moe_ppo.yaml` (64 prompts × 1 response, GAE with γ = λ = 1 and a critic "
        "started from the policy); REINFORCE++ is `recipes/tiny_moe.yaml` with "
        "`algo.advantage=reinforce_pp rollout.group_size=1` (64 prompts × 1 response, returns "
        "whitened over the batch). Everything else, the stability stack included, is the recipe's. "
        "Each run is the loop of `moe-rl train` with its one trainer rank and one Megatron engine in "
        "one process (`moe_rl.orchestration.local`, without Ray), two runs at a time. "
        f'Steps count from 0; "first ≥ {THRESHOLD}" is the first step whose reward/mean reaches '
        f"{THRESHOLD}; \"within GRPO's steps\" compares it with GRPO's first step at the same seed; "
        f'"final" is the mean reward of the last {WINDOW} steps.',
        "",
        f"## First step with reward ≥ {THRESHOLD} and final reward",
        "",
        f"| estimator | seed | first step ≥ {THRESHOLD} | within GRPO's steps | final reward |",
        "|---|---|---|---|---|",
    ]
    curves = {
        (e, seed): [r["reward/mean"] for r in read_metrics(out / f"{e}-seed{seed}")][:steps]
        for e in ESTIMATORS
        for seed in seeds
    }
    for (estimator, seed), rewards in curves.items():
        first, grpo = first_step(rewards), first_step(curves["grpo", seed])
        reached = str(first) if first is not None else f"not within {len(rewards)} steps"
        within = (
            "–"
            if estimator == "grpo"
            else "yes"
            if first is not None and (grpo is None or first <= grpo)
            else "no"
        )
        final = sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]) if rewards else float("nan")
        lines.append(f"| {LABELS[estimator]} | {seed} | {reached} | {within} | {final:.3f} |")
    windows = [(start, min(start + WINDOW, steps)) for start in range(0, steps, WINDOW)]
    lines += [
        "",
        f"## Mean reward per {WINDOW} steps",
        "",
        "| estimator | seed | " + " | ".join(f"{a}–{b - 1}" for a, b in windows) + " |",
        "|---|---|" + "---|" * len(windows),
    ]
    for (estimator, seed), rewards in curves.items():
        cells = [f"{sum(rewards[a:b]) / len(rewards[a:b]):.3f}" if rewards[a:b] else "–" for a, b in windows]
        lines.append(f"| {estimator} | {seed} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## REINFORCE++: advantage statistics against a hand computation",
        "",
        "With γ = 1 and no KL in the reward, a response's raw token advantage (its return) is its "
        "reward R_i on each of its L_i tokens, so advantage/token_mean_raw must equal "
        "Σ L_i R_i / Σ L_i over the step's responses and advantage/token_std_raw the unbiased std of "
        "each R_i repeated L_i times. L_i and R_i are read from the run's dumped trajectories.",
        "",
        "| seed | steps checked | token_mean_raw: max abs diff | max rel diff "
        "| token_std_raw: max abs diff | max rel diff |",
        "|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        checked, *diffs = hand_check(out / f"reinforce_pp-seed{seed}")
        lines.append(f"| {seed} | {checked} | " + " | ".join(f"{d:.1e}" for d in diffs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated run.seed values")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run directories")
    parser.add_argument("--report-only", action="store_true", help="no runs: report what --out holds")
    parser.add_argument("--write", type=Path, help="write the markdown report here (else stdout)")
    parser.add_argument(
        "--run-one", nargs=4, metavar=("ESTIMATOR", "SEED", "STEPS", "RUN_DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.run_one:
        estimator, seed, steps, run_dir = args.run_one
        run_one(estimator, int(seed), int(steps), Path(run_dir))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        jobs = [(e, s) for s in seeds for e in args.estimators.split(",")]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for run_dir in pool.map(lambda job: train(*job, args.steps, args.out, args.jobs), jobs):
                print(f"done: {run_dir.name}", flush=True)
    text = report(args.out, seeds, args.steps)
    if args.write:
        args.write.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
