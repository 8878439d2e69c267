"""The tool task from scratch and from a supervised warm start, with and without dynamic sampling
(and RL-ZVP shaping, the other remedy for groups whose rewards all agree), over several seeds.

    python bench/tool_warm_start.py                 # SFT once per seed, every arm, the report
    python bench/tool_warm_start.py --seeds 0 --sft-steps 20 --rl-steps 5   # smoke
    python bench/tool_warm_start.py --report        # only the report, from the results in --out

Task and model: `recipes/tiny_moe_tools.yaml` (a calculator tool for two-digit products; reward 1
for the exact product, partial credit otherwise, plus 0.5 x the best call: at most 1.5). Per seed,
`moe-rl sft` first trains the model on `--demonstrations` demonstrations the calculator writes (a
call of the prompt's product, then the result as the answer), `--sft-steps` steps; then each arm
runs `--rl-steps` RL steps in the in-process loop (`python -m moe_rl.orchestration.local`):

* ``scratch``: the recipe as shipped (random initial weights, `trainer.lr` 5e-3);
* ``scratch+ds``: and dynamic sampling (`algo.dynamic_sampling`, 4 rounds);
* ``scratch+zvp``: and RL-ZVP shaping instead (`algo.zero_variance_shaping`);
* ``sft``: from the seed's SFT run (`model.init_from`), `trainer.lr` 5e-4 (the recipe's 5e-3 on a
  fresh Adam moves every weight of a trained model by about the learning rate at the first step
  and undoes the warm start);
* ``sft+ds``: and dynamic sampling.

A finished arm leaves `<out>/<arm>-seed<k>.json` (its per-step series); arms with a result are
skipped. The report (`--doc`, default docs/tool_warm_start.md, and the PNG beside it) gives per arm,
mean ± std over seeds, the final reward (mean of the last 10 % of steps), the mean reward over
the run, the zero-variance group share and dynamic sampling's rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the stack-effect bench's runner and statistics

import stack_effect as se  # noqa: E402

log = logging.getLogger("tool_warm_start")

RECIPE = "recipes/tiny_moe_tools.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "tool_warm_start"
DEFAULT_DOC = REPO / "docs" / "tool_warm_start.md"
DS = ("algo.dynamic_sampling=true", "algo.dynamic_sampling_rounds=4")
SFT_LR = "trainer.lr=5.0e-4"
ARMS = {
    "scratch": (False, ()),
    "scratch+ds": (False, DS),
    "scratch+zvp": (False, ("algo.zero_variance_shaping=true",)),
    "sft": (True, (SFT_LR,)),
    "sft+ds": (True, (SFT_LR, *DS)),
}
"""Arm -> (starts from the SFT run, its overrides)."""
SERIES = (
    "reward/mean", "reward/max", "advantage/zero_variance_group_share", "sampling/rounds",
    "sampling/dropped_group_share", "env/tool_calls_per_trajectory", "train/grad_norm", "time/step_s",
)  # fmt: skip
COLORS = {"scratch": "tab:red", "scratch+ds": "tab:orange", "scratch+zvp": "tab:brown", "sft": "tab:blue",
          "sft+ds": "tab:green"}  # fmt: skip


def sft_dir(out: Path, seed: int) -> Path:
    return out / "runs" / f"sft-seed{seed}"


def run_sft(out: Path, seed: int, steps: int, demonstrations: int) -> Path:
    """The seed's SFT run through `moe-rl sft` (kept when it finished already)."""
    run = sft_dir(out, seed)
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*/manifest.json")):
        log.info("sft seed %d: done already (%s)", seed, run)
        return run
    command = [
        sys.executable, "-m", "launch.cli", "sft", RECIPE, "--force-new", f"run.seed={seed}", f"run.steps={steps}",
        f"sft.num_demonstrations={demonstrations}", f"run.output_dir={run.parent}", f"run.name={run.name}",
        "logging.progress=false",
    ]  # fmt: skip
    log_path = out / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as err:
        code, wall, _ = se.spawn(command, err, err, {})
    if code != 0:
        raise SystemExit(f"sft seed {seed}: exit code {code} ({log_path})")
    log.info("sft seed %d: %.0f s, %s", seed, wall, run)
    return run


def run_arm(out: Path, arm: str, seed: int, steps: int, jobs: int) -> dict:
    from_sft, overrides = ARMS[arm]
    init = [f"model.init_from={sft_dir(out, seed)}"] if from_sft else []
    args = [RECIPE, f"run.seed={seed}", f"run.steps={steps}", "logging.progress=false", *init, *overrides]
    name = f"{arm}-seed{seed}"
    metrics, log_path = out / "runs" / "rl" / name / "metrics.jsonl", out / "logs" / f"{name}.log"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as err, metrics.open("w") as stdout:
        where = [f"run.output_dir={out / 'run_dirs' / 'rl'}", f"run.name={name}"]  # its checkpoints
        command = [sys.executable, "-m", "moe_rl.orchestration.local", "--force-new", *args, *where]
        code, wall, cpu = se.spawn(command, stdout, err, se.thread_env(jobs, in_process=True))
    if code != 0:
        raise RuntimeError(f"{name}: exit code {code} ({log_path})")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
    series = {k: [r.get(k) for r in records] for k in SERIES if any(k in r for r in records)}
    return {
        "arm": arm, "seed": seed, "steps": steps, "command": " ".join(args), "wall_s": wall, "cpu_s": cpu,
        "commit": se.git_commit(), "finished": datetime.now(UTC).isoformat(timespec="seconds"), "series": series,
    }  # fmt: skip


def arm_numbers(series: dict) -> dict[str, float | None]:
    rewards = series["reward/mean"]
    rounds = [v for v in series.get("sampling/rounds", []) if v is not None]
    flat = [v for v in series.get("advantage/zero_variance_group_share", []) if v is not None]
    return {
        "final": se.final_reward(rewards),
        "mean": sum(rewards) / len(rewards),
        "flat": sum(flat) / len(flat) if flat else None,
        "rounds": sum(rounds) / len(rounds) if rounds else None,
    }


COLUMNS = (
    ("final", "final reward", "{:.3f}"), ("mean", "mean reward", "{:.3f}"),
    ("flat", "zero-variance group share", "{:.2f}"), ("rounds", "generation rounds a step", "{:.2f}"),
)  # fmt: skip


def report(out: Path, doc: Path, args: argparse.Namespace) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not results:
        raise SystemExit(f"no results in {out}")
    by_arm = {arm: [r for r in results if r["arm"] == arm] for arm in ARMS}
    lines = [
        "# The tool task: from scratch and from a supervised warm start",
        "",
        "Regenerate (results in `bench/results/tool_warm_start/`) and this page:",
        "",
        "```bash",
        f"python bench/tool_warm_start.py --seeds {','.join(str(s) for s in args.seeds)} "
        f"--sft-steps {args.sft_steps} --rl-steps {args.rl_steps} --demonstrations {args.demonstrations}",
        "```",
        "",
        f"Report written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from {len(results)} runs at commit "
        f"{', '.join(sorted({r['commit'] for r in results}))}. The arms, the task and the reward are "
        "described in `bench/tool_warm_start.py`; the SFT runs train on demonstrations the calculator "
        "environment writes (`moe-rl sft`, `sft.demonstrations=env`).",
        "",
        "| arm | seeds | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---" * (2 + len(COLUMNS)) + "|",
    ]
    for arm, runs in by_arm.items():
        if not runs:
            continue
        found = [arm_numbers(r["series"]) for r in runs]
        cells = [se.mean_std([f[k] for f in found if f[k] is not None], fmt) for k, _, fmt in COLUMNS]
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"![reward curves]({doc.with_suffix('.png').name})",
        "",
        "- **final reward**: mean `reward/mean` of the last 10 % of steps (at most 1.5: 1 for the exact "
        "product, 0.5 for a call of the right value).",
        "- **mean reward**: mean `reward/mean` over the run.",
        "- **zero-variance group share**: mean share of a step's groups whose rewards all agree "
        "(no advantage): with dynamic sampling, only those the round bound made the batch keep.",
        "- **generation rounds a step**: dynamic sampling's mean rounds (1 is a step without refills).",
        "",
    ]
    doc.write_text("\n".join(lines))
    write_png(doc.with_suffix(".png"), by_arm)
    log.info("wrote %s and %s", doc, doc.with_suffix(".png"))


def write_png(path: Path, by_arm: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, runs in by_arm.items():
        if runs:
            se.plot_arm(ax, runs, f"{arm} ({se.plural(len(runs), 'seed')})", COLORS[arm])
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (trailing mean)")
    ax.set_title("tool task: mean over seeds, band ±1 std")
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--demonstrations", type=int, default=1024)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"from {','.join(ARMS)}")
    parser.add_argument("--jobs", type=int, default=2, help="RL arms at a time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    parser.add_argument("--report", action="store_true", help="only the report, from the stored results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        arms = args.arms.split(",")
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
        for seed in args.seeds:
            if any(ARMS[a][0] for a in arms):
                run_sft(args.out, seed, args.sft_steps, args.demonstrations)
        todo = [(a, s) for s in args.seeds for a in arms if not (args.out / f"{a}-seed{s}.json").is_file()]
        failed = 0
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {
                pool.submit(run_arm, args.out, a, s, args.rl_steps, args.jobs): (a, s) for a, s in todo
            }
            for future in as_completed(futures):
                arm, seed = futures[future]
                try:
                    result = future.result()
                except RuntimeError as exc:
                    log.error("%s", exc)
                    failed += 1
                    continue
                (args.out / f"{arm}-seed{seed}.json").write_text(json.dumps(result))
                rewards = result["series"]["reward/mean"]
                log.info(
                    "%s seed %d: %.0f s, final reward %.3f",
                    arm,
                    seed,
                    result["wall_s"],
                    se.final_reward(rewards),
                )
        if failed:
            return 1
    report(args.out, args.doc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
