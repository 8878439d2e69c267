"""The stability stack's effect on learning under conditions that make real training–inference
mismatch on CPU: each condition run with the stack off and on, over several seeds.

    python bench/stack_effect.py --jobs 2          # every condition × {off, on} × seeds 0,1,2; report
    python bench/stack_effect.py --conditions reference,truncation --seeds 0 --steps 3   # smoke
    python bench/stack_effect.py --conditions bypass_truncation --arms off,corrections --steps 300
    python bench/stack_effect.py --dry-run         # validate every run's recipe, print the commands
    python bench/stack_effect.py --report          # only the report, from the results in --out

The model and task are `recipes/bench/stack_effect.yaml`; each condition and arm is a list of
overrides of it (`CONDITIONS`, `ARMS`; `--dry-run` prints them). "off" is the plain objective
(PPO-clip, token-mean) without routing replay, keep-sampling-mask, IcePop, OPSM, TIS or
rejection, so the trainer's log-probs are over the full vocabulary; "corrections" is the plain
objective with the recipe's corrections (R3, keep-sampling-mask, IcePop, OPSM); "on" is the
recipe's stack (those corrections and ESPO). The paired differences split the stack's effect into
the corrections' (corrections − off) and the objective's (on − corrections).

Every run is a subprocess. Runs of one trainer rank and the Megatron engine use the in-process
loop (`python -m moe_rl.orchestration.local`: the trainer, engine and metrics of a one-rank
`moe-rl train` without Ray, which starts in about 8 s instead of 40 and saves a third of each step's
time; an async run there generates each batch when it is launched, with the weights of that moment,
so its tokens are as old as on Ray and only the overlap is gone); others run `moe-rl train` on Ray,
one at a time after the others. A finished run leaves
`<out>/<condition>-<arm>-seed<k>-<steps>steps.json` (settings, the resolved stack, timing, per-step series);
runs with a result are skipped, so an interrupted experiment continues where it stopped. With
`--jobs N` > 1 the in-process runs go N at a time with cores / N threads each (OMP_NUM_THREADS);
Ray runs get OMP_WAIT_POLICY=PASSIVE (`thread_env`).

The report (`--doc`, default docs/stack_effect.md, and the PNG beside it) gives per condition and
arm, mean ± std over seeds: final reward (mean of the last 10 % of steps), area under the reward
curve (its mean over the steps), steps until the trailing mean reward reaches `--threshold`, max
grad norm, mean KL k3 and the standard deviation of the IS ratio π_old/μ, all read from the
runs' `metrics.jsonl`, and on − off paired by seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/stack_effect.py` from anywhere

from moe_rl.config import ConfigError, RecipeConfig  # noqa: E402 (light: no torch, no Ray)
from moe_rl.config.derived import CORRECTIONS_OFF  # noqa: E402
from moe_rl.orchestration.preflight import load_checked  # noqa: E402

log = logging.getLogger("stack_effect")

RECIPE = "recipes/bench/stack_effect.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "stack_effect"
DEFAULT_DOC = REPO / "docs" / "stack_effect.md"
DEFAULT_STEPS = 300
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class Condition:
    name: str
    what: str
    overrides: tuple[str, ...]


WIDE = ("model.num_experts=64", "model.moe_router_topk=8", "model.moe_ffn_hidden_size=32")
"""The wider MoE of the wide_* conditions, where routing flips weigh more."""

CONDITIONS = {
    c.name: c
    for c in (
        Condition("reference", "bf16 weights, top_p = 1, sync: no mismatch to correct", ()),
        Condition(
            "truncation",
            "top_p = 0.7 and top_k = 8 (of 16 tokens): the engine's log-probs are normalized over "
            "the kept set, the trainer's over the full vocabulary unless keep-sampling-mask is on",
            ("rollout.top_p=0.7", "rollout.top_k=8"),
        ),
        Condition(
            "bypass",
            "algo.policy_mode = bypass: the loss takes the engine's log-probs as π_old (no recomputed "
            "π_old in the ratio, as frameworks that skip that pass do); a control with no mismatch",
            ("algo.policy_mode=bypass",),
        ),
        Condition(
            "bypass_truncation",
            "truncation's sampling (top_p = 0.7, top_k = 8) in bypass mode: the objective's ratio is "
            "π_θ/μ, so the truncation's mismatch enters the ratio and its clip",
            ("rollout.top_p=0.7", "rollout.top_k=8", "algo.policy_mode=bypass"),
        ),
        Condition(
            "quantization", "int4_awq rollout weights (AWQ-calibrated INT4)", ("rollout.quant=int4_awq",)
        ),
        Condition(
            "staleness",
            "async (generation one policy version behind), run.max_staleness = 2, 4 mini-batches "
            "(optimizer steps) per rollout batch",
            ("run.mode=async", "run.max_staleness=2", "trainer.num_mini_batches=4"),
        ),
        Condition(
            "deep_staleness",
            "async, generation 4 steps ahead: every batch is 4 policy versions (16 optimizer steps) old "
            "when it trains, run.max_staleness = 4, 4 mini-batches per rollout batch",
            ("run.mode=async", "run.async_depth=4", "run.max_staleness=4", "trainer.num_mini_batches=4"),
        ),
        Condition(
            "inflight",
            "async, generation 2 steps ahead with in-flight weight updates: a sync lands in the "
            "generation in progress, whose later tokens are the new version's; run.max_staleness = 2, "
            "4 mini-batches per rollout batch, responses of up to 24 tokens",
            (
                "run.mode=async",
                "run.async_depth=2",
                "run.max_staleness=2",
                "rollout.inflight_updates=true",
                "trainer.num_mini_batches=4",
                "rollout.max_new_tokens=24",
            ),
        ),
        Condition(
            "wide_bf16",
            "a wider MoE (64 experts, top-8, expert width 32) at 4x the learning rate, bf16 rollout "
            "weights: wide_fp8 without its mismatch",
            (*WIDE, "trainer.lr=2.0e-3"),
        ),
        Condition(
            "wide_fp8",
            "the wider MoE of wide_bf16 at 4x the learning rate with fp8_tensor rollout weights (one "
            "scale per tensor)",
            (*WIDE, "trainer.lr=2.0e-3", "rollout.quant=fp8_tensor"),
        ),
    )
}
CORRECTIONS_ONLY = ("algo.objective=ppo_clip", "algo.aggregation=token_mean", "trainer.compute_entropy=false")
"""The recipe's corrections (R3, keep-sampling-mask, IcePop, OPSM) under the plain objective."""
STACK_OFF = (*CORRECTIONS_ONLY, *CORRECTIONS_OFF)
"""The plain objective without any correction."""
ARMS = {"off": STACK_OFF, "corrections": CORRECTIONS_ONLY, "on": ()}
COLORS = {"off": "tab:red", "corrections": "tab:green", "on": "tab:blue"}
PAIRS = (
    ("on", "off", "whole stack"),
    ("corrections", "off", "corrections"),
    ("on", "corrections", "objective"),
)
"""Paired differences: the whole stack; the corrections alone; the objective (ESPO against
PPO-clip, both with the corrections)."""
SERIES = (
    "reward/mean",
    "train/grad_norm",
    "old/kl_k3",
    "old/chi2_token",
    "old/ess_token",
    "policy/staleness",
    "train/clip_frac",
    "train/icepop_masked_frac",
    "train/opsm_masked_seq_frac",
    "old/routing_agreement",
    "rollout/mixed_version_share",
    "time/step_s",
)
"""Per-step metrics kept in a run's result (those a run does not log are left out)."""


# --------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    condition: Condition
    arm: str
    seed: int
    steps: int
    recipe: str
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.condition.name}-{self.arm}-seed{self.seed}-{self.steps}steps"

    @property
    def overrides(self) -> list[str]:
        return [
            *self.condition.overrides, *ARMS[self.arm], *self.extra,
            f"run.seed={self.seed}", f"run.steps={self.steps}", "logging.progress=false",
        ]  # fmt: skip

    def settings(self) -> dict:
        """What makes two results of this run comparable."""
        return {"recipe": self.recipe, "overrides": self.overrides}

    def config(self) -> RecipeConfig:
        """The run's resolved, validated recipe; one that does not validate stops the experiment
        before any run starts, with the field and value."""
        try:
            return load_checked(REPO / self.recipe, self.overrides)
        except ConfigError as exc:
            raise SystemExit(f"{self.condition.name} / stack {self.arm}: {exc}") from None

    def in_process(self) -> bool:
        """Whether the in-process loop can run it: online (sync, or async: it generates a batch when
        launched, with the weights of that moment, so its tokens are as old as on Ray; only the
        overlap is gone), one trainer rank, the Megatron engine."""
        config = self.config()
        return (
            config.run.mode in ("sync", "async")
            and not config.rollout.inflight_updates  # a sync beside a generation needs Ray's threads
            and config.parallel.trainer_world_size == 1
            and config.rollout.engine == "megatron"
        )

    def command(self, out: Path, in_process: bool) -> list[str]:
        where = [f"run.output_dir={out / 'runs'}", f"run.name={self.name}"]
        if in_process:
            return [
                sys.executable,
                "-m",
                "moe_rl.orchestration.local",
                "--force-new",
                self.recipe,
                *self.overrides,
                *where,
            ]
        return [
            sys.executable,
            "-m",
            "launch.cli",
            "train",
            "--force-new",
            self.recipe,
            *self.overrides,
            *where,
        ]


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Seeds outermost, so that an interrupted experiment has whole seeds of every condition."""
    return [
        Run(CONDITIONS[c], arm, seed, args.steps, args.recipe, tuple(args.override))
        for seed in args.seeds
        for c in args.conditions
        for arm in args.arms
    ]


def stack_of(config: RecipeConfig) -> str:
    """The objective and corrections a run trains with, in words."""
    a, c = config.algo, config.algo.corrections
    return ", ".join(
        [
            f"{a.objective} objective", f"{a.aggregation} aggregation", f"routing replay {a.routing_replay}",
            f"keep-sampling-mask {'on' if c.keep_sampling_mask else 'off'}",
            f"IcePop [{c.icepop.low}, {c.icepop.high}]" if c.icepop.enabled else "IcePop off",
            f"OPSM δ = {c.opsm.delta}" if c.opsm.enabled else "OPSM off",
            f"TIS {c.tis.mode} (cap {c.tis.cap})" if c.tis.mode != "off" else "TIS off",
            "rejection on" if c.rejection.enabled else "rejection off",
        ]
    )  # fmt: skip


def thread_env(jobs: int, in_process: bool) -> dict[str, str]:
    """One share of the cores per concurrent run (nothing set for one run at a time). A Ray run's
    trainer and engine each take every core and, async, compute at once: OpenMP threads that sleep
    while they wait (instead of spinning) make its steps about 2.5× faster on 2 cores, with the
    same results."""
    if not in_process:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if jobs <= 1:
        return {}
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    return {k: threads for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def git_commit() -> str:
    found = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=REPO, capture_output=True, text=True
    )
    return found.stdout.strip() or "unknown"


def spawn(command: list[str], stdout, stderr, env: dict[str, str]) -> tuple[int, float, float]:
    """Run ``command`` in the repository with ``env`` added; return its exit code, wall seconds
    and CPU seconds (its own and those of the descendants it waited for: a Ray run's actors are
    not among them)."""
    env = {**os.environ, **env}
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def execute(run: Run, out: Path, in_process: bool, jobs: int) -> dict:
    """Run one subprocess; return its result (settings, timing, per-step series). The in-process
    loop prints its metrics, `moe-rl train` writes them: both end in `<out>/runs/<name>/`."""
    metrics = out / "runs" / run.name / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    log_path = out / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as err, metrics.open("w") if in_process else err as stdout:
        code, wall, cpu = spawn(run.command(out, in_process), stdout, err, thread_env(jobs, in_process))
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{run.name}: exit code {code} ({log_path}):\n  " + "\n  ".join(tail))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
    if len(records) != run.steps:
        raise RuntimeError(f"{run.name}: {len(records)} steps in {metrics}, expected {run.steps}")
    series = {k: [r.get(k) for r in records] for k in SERIES if any(k in r for r in records)}
    return {
        "name": run.name, "condition": run.condition.name, "arm": run.arm, "seed": run.seed,
        "steps": run.steps, "settings": run.settings(), "extra": list(run.extra),
        "stack": stack_of(run.config()),
        "runner": "local" if in_process else "ray", "jobs": jobs,
        "threads": thread_env(jobs, in_process).get("OMP_NUM_THREADS", "default"), "cpus": os.cpu_count(),
        "commit": git_commit(), "wall_s": wall, "cpu_s": cpu if in_process else None,
        "startup_s": wall - sum(series["time/step_s"]),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"), "series": series,
    }  # fmt: skip


def pending(runs: Sequence[Run], out: Path) -> list[Run]:
    """The runs without a result; a result made with other settings is an error."""
    todo = []
    for run in runs:
        path = out / f"{run.name}.json"
        if not path.is_file():
            todo.append(run)
            continue
        if json.loads(path.read_text())["settings"] != run.settings():
            raise SystemExit(
                f"{path} was made with other settings than this run's {run.settings()}; "
                "use another --out or delete it"
            )
        log.info("%s: done already (%s)", run.name, path)
    return todo


def run_all(runs: Sequence[Run], out: Path, jobs: int) -> int:
    """Run what is missing; returns the number of failed runs. In-process runs go `jobs` at a time;
    Ray runs one at a time after them, with the machine to themselves (their actors size their
    torch threads by the machine's cores, whatever OMP_NUM_THREADS says, and an async run's
    trainer and engine compute at once)."""
    in_process = {run: run.in_process() for run in runs}  # validates every recipe first
    todo = pending(runs, out)
    local = [run for run in todo if in_process[run]]
    phases = ((local, jobs), ([run for run in todo if not in_process[run]], 1))
    done = failed = 0
    for batch, workers in phases:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(execute, run, out, in_process[run], workers): run for run in batch}
            for future in as_completed(futures):
                done += 1
                failed += not store(futures[future], future, out, f"[{done}/{len(todo)}]")
    return failed


def store(run: Run, future, out: Path, counter: str) -> bool:
    """Write a finished run's result (atomically); log a failed one. Returns whether it finished."""
    try:
        result = future.result()
    except RuntimeError as exc:
        log.error("%s %s", counter, exc)
        return False
    path = out / f"{run.name}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)
    log.info(
        "%s %s: %.0f s (start-up %.0f s, %s), final reward %.3f", counter, run.name, result["wall_s"],
        result["startup_s"], result["runner"], final_reward(result["series"]["reward/mean"]),
    )  # fmt: skip
    return True


# ------------------------------------------------------------------------------------ metrics
def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(steps: int) -> int:
    return max(1, steps // 20)


def final_reward(rewards: Sequence[float]) -> float:
    tail = rewards[-max(1, round(len(rewards) / 10)) :]
    return sum(tail) / len(tail)


def steps_to(rewards: Sequence[float], threshold: float) -> int | None:
    """The first step (1-based) whose trailing mean reward reaches ``threshold``; None if none."""
    smooth = trailing_mean(rewards, smoothing_window(len(rewards)))
    return next((i + 1 for i, r in enumerate(smooth) if r >= threshold), None)


def run_metrics(series: dict[str, list], threshold: float) -> dict[str, float | None]:
    """The report's numbers of one run (the module docstring defines them)."""

    def values(key: str) -> list[float]:
        return [v for v in series.get(key, []) if v is not None and math.isfinite(v)]

    rewards = values("reward/mean")
    grad, kl = values("train/grad_norm"), values("old/kl_k3")
    spread = [
        math.sqrt(max(0.0, (1 + chi2) * (1 - ess)))
        for chi2, ess in zip(series.get("old/chi2_token", []), series.get("old/ess_token", []))
        if chi2 is not None and ess is not None and math.isfinite(chi2) and math.isfinite(ess)
    ]
    route, mixed = values("old/routing_agreement"), values("rollout/mixed_version_share")
    smooth = trailing_mean(rewards, smoothing_window(len(rewards)))
    return {
        "final": final_reward(rewards),
        "drop": max(smooth) - final_reward(rewards),
        "auc": sum(rewards) / len(rewards),
        "to_threshold": steps_to(rewards, threshold),
        "grad_max": max(grad) if grad else None,
        "kl_k3": sum(kl) / len(kl) if kl else None,
        "is_std": sum(spread) / len(spread) if spread else None,
        "route": sum(route) / len(route) if route else None,
        "mixed": sum(mixed) / len(mixed) if mixed else None,
    }


# ------------------------------------------------------------------------------------- report
COLUMNS = (
    ("final", "final reward", "{:.3f}"),
    ("drop", "peak − final", "{:.3f}"),
    ("auc", "AUC", "{:.3f}"),
    ("to_threshold", "steps to {threshold}", "{:.0f}"),
    ("grad_max", "max grad norm", "{:.2f}"),
    ("kl_k3", "mean KL k3", "{:.2e}"),
    ("is_std", "IS-ratio std", "{:.3g}"),
    ("route", "routing agreement", "{:.3f}"),
    ("mixed", "mixed-version share", "{:.3f}"),
)


def load_results(out: Path) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not results:
        raise SystemExit(f"no results in {out}: run the experiment first (without --report)")
    return results


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def mean_std(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


def cell(key: str, found: list[dict], fmt: str) -> str:
    values = [m[key] for m in found if m[key] is not None]
    text = mean_std(values, fmt)
    if key == "to_threshold" and len(values) < len(found):
        return f"{text} ({len(values)}/{len(found)} reached)" if values else f"not reached (0/{len(found)})"
    return text


def grouped(results: list[dict]) -> dict[tuple[str, int, str], list[dict]]:
    """(condition, steps, arm) -> its runs, in the order of `CONDITIONS`, shorter runs first."""
    order = {name: i for i, name in enumerate(CONDITIONS)}
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: (order.get(r["condition"], 99), r["steps"], r["arm"], r["seed"])):
        groups.setdefault((r["condition"], r["steps"], r["arm"]), []).append(r)
    return groups


def panels(groups: dict) -> list[tuple[str, int]]:
    """The (condition, steps) pairs the results hold: one row block, one pairing, one plot each."""
    return list(dict.fromkeys((condition, steps) for condition, steps, _ in groups))


def results_table(groups: dict, threshold: float) -> list[str]:
    heads = [title.format(threshold=threshold) for _, title, _ in COLUMNS]
    lines = [
        "| condition | steps | stack | seeds | " + " | ".join(heads) + " |",
        "|---" * (4 + len(heads)) + "|",
    ]
    for (condition, steps, arm), runs in groups.items():
        found = [run_metrics(r["series"], threshold) for r in runs]
        cells = [cell(key, found, fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {condition} | {steps} | {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def paired_table(groups: dict, threshold: float) -> list[str]:
    """Each pair of `PAIRS` (a − b) of final reward and AUC, per seed run in both arms."""
    lines = ["| condition | steps | effect | a − b | seeds | Δ final reward | Δ AUC |", "|---" * 7 + "|"]
    for condition, steps in panels(groups):
        arms = {
            arm: {
                r["seed"]: run_metrics(r["series"], threshold)
                for r in groups.get((condition, steps, arm), [])
            }
            for arm in ARMS
        }
        for a, b, effect in PAIRS:
            seeds = sorted(set(arms[a]) & set(arms[b]))
            if not seeds:
                continue
            deltas = {k: [arms[a][s][k] - arms[b][s][k] for s in seeds] for k in ("final", "auc")}
            lines.append(
                f"| {condition} | {steps} | {effect} | {a} − {b} | {len(seeds)} | {mean_std(deltas['final'], '{:+.3f}')} | "
                f"{mean_std(deltas['auc'], '{:+.3f}')} |"
            )
    return lines


def timing_table(groups: dict) -> list[str]:
    heads = "| condition | steps | stack | runner | threads | s / step | start-up s | wall s | CPU s |"
    lines = [heads, "|---" * 9 + "|"]
    for (condition, steps, arm), runs in groups.items():
        per_step = [
            statistics.median(r["series"]["time/step_s"][1:] or r["series"]["time/step_s"]) for r in runs
        ]
        cpu = [r["cpu_s"] for r in runs if r.get("cpu_s") is not None]
        cells = [
            runs[0]["runner"], str(runs[0]["threads"]), mean_std(per_step, "{:.2f}"),
            mean_std([r["startup_s"] for r in runs], "{:.0f}"), mean_std([r["wall_s"] for r in runs], "{:.0f}"),
            mean_std(cpu, "{:.0f}"),
        ]  # fmt: skip
        lines.append(f"| {condition} | {steps} | {arm} | " + " | ".join(cells) + " |")
    return lines


def regenerate_commands(results: list[dict], threshold: float) -> list[str]:
    """One command per run length that makes the stored results again."""
    commands = []
    for steps in sorted({r["steps"] for r in results}):
        these = [r for r in results if r["steps"] == steps]
        first = these[0]
        conditions = ",".join(dict.fromkeys(c for c, _, _ in grouped(these)))
        seeds = ",".join(str(s) for s in sorted({r["seed"] for r in these}))
        words = ["python", "bench/stack_effect.py", "--conditions", conditions, "--seeds", seeds]
        arms = [arm for arm in ARMS if any(r["arm"] == arm for r in these)]
        if len(arms) < len(ARMS):
            words += ["--arms", ",".join(arms)]
        words += ["--steps", str(steps), "--jobs", str(max(r["jobs"] for r in these))]
        if first["settings"]["recipe"] != RECIPE:
            words += ["--recipe", first["settings"]["recipe"]]
        for extra in first["extra"]:
            words += ["--override", extra]
        if threshold != DEFAULT_THRESHOLD:
            words += ["--threshold", str(threshold)]
        commands.append(shlex.join(words))
    return commands


def write_markdown(doc: Path, results: list[dict], threshold: float) -> None:
    groups = grouped(results)
    steps = sorted({r["steps"] for r in results})
    windows = ", ".join(f"{plural(smoothing_window(n), 'step')} in {n}" for n in steps)
    commits = ", ".join(sorted({r["commit"] for r in results}))
    conditions = [CONDITIONS[c] for c in dict.fromkeys(c for c, _, _ in groups) if c in CONDITIONS]
    stacks = {r["arm"]: r["stack"] for r in results}
    lines = [
        "# Stack-effect experiment",
        "",
        "The stability stack on and off under conditions that make training–inference mismatch on "
        "CPU, measured as it came out. Regenerate the runs (skips those with a result in "
        "`bench/results/stack_effect/`) and this page:",
        "",
        "```bash",
        *regenerate_commands(results, threshold),
        "python bench/stack_effect.py --report   # this page and the PNG from the stored results",
        "```",
        "",
        f"Report written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; runs finished "
        f"{min(r['finished'] for r in results)[:16]} – {max(r['finished'] for r in results)[:16]} "
        f"UTC at commit {commits}, {results[0]['cpus']} CPU cores, {len(results)} runs.",
        "",
        "## Settings",
        "",
        f"Recipe `{results[0]['settings']['recipe']}` (the model and task: see its comments), "
        f"{', '.join(map(str, steps))} steps per run"
        + (f", extra overrides `{' '.join(results[0]['extra'])}`" if results[0]["extra"] else "")
        + ", `run.seed` = the seed.",
        "",
        "| condition | what | overrides |",
        "|---|---|---|",
        *(f"| {c.name} | {c.what} | `{' '.join(c.overrides) or '(none)'}` |" for c in conditions),
        "",
        f"- **stack off**: `{' '.join(STACK_OFF)}`: {stacks.get('off', '–')}",
        f"- **corrections only**: `{' '.join(CORRECTIONS_ONLY)}`: {stacks.get('corrections', '–')}",
        f"- **stack on**: the recipe's stability stack: {stacks.get('on', '–')}",
        "",
        "## Results",
        "",
        "Mean ± std over seeds.",
        "",
        *results_table(groups, threshold),
        "",
        "On − off, paired by seed (same initial weights and prompts):",
        "",
        *paired_table(groups, threshold),
        "",
        f"![reward curves: one panel per condition, stack off and on](./{doc.with_suffix('.png').name})",
        "",
        *definitions(threshold, windows),
        "",
        "## Timing",
        "",
        "Median step time after the first step (wall); start-up is the wall time outside the steps "
        "(imports, model and engine start, the final checkpoint of Ray runs); CPU s is the run's "
        "process CPU time (in-process runs only: a Ray run's actors are not its children). Wall "
        "times depend on what else the machine runs.",
        "",
        *timing_table(groups),
        "",
    ]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))


def definitions(threshold: float, windows: str) -> list[str]:
    """The columns' meanings; ``windows`` says the trailing-mean window of each run length."""
    return [
        "- **final reward**: mean `reward/mean` of the last 10 % of steps.",
        f"- **peak − final**: the highest trailing mean reward (over 1/20 of the run: {windows}) minus the "
        "final reward: how far a run fell from its best (a collapse), 0 for one that ends at its best.",
        "- **AUC**: area under the reward curve divided by the steps (the mean reward over the run).",
        f"- **steps to {threshold}**: the first step whose trailing mean reward (over 1/20 of the run) "
        f"reaches {threshold}; mean over the seeds that reach it.",
        "- **max grad norm**: largest `train/grad_norm` (before clipping; per step the mean over its "
        "optimizer steps).",
        "- **mean KL k3**: mean of `old/kl_k3`, KL(μ ‖ π_old) on the sampled tokens, π_old as the "
        "loss sees it (normalized over the kept set with keep-sampling-mask, routed as the engine "
        "routed with R3), μ the engine's log-probs.",
        "- **IS-ratio std**: the standard deviation of ρ = π_old/μ over a step's sampled tokens, "
        "√(mean(ρ²) − mean(ρ)²) = √((1 + χ²) (1 − ESS)) from `old/chi2_token` = mean(ρ²) − 1 and "
        "`old/ess_token` = mean(ρ)² / mean(ρ²) (no metric logs it directly; both are means over "
        "micro-batches, so this is one too), averaged over the steps. Under truncation without "
        "keep-sampling-mask mean(ρ) < 1 (μ renormalized over the kept set), so χ² alone is no "
        "variance there.",
        "- **routing agreement**: mean `old/routing_agreement`, the share of the engine's top-k expert "
        "choices the trainer's routers make too on the sampled sequences; 1 − it is the routing-flip "
        "rate. Measured where the engine returns its routing (routing replay on: not in the 'off' arm).",
        "- **mixed-version share**: mean `rollout/mixed_version_share`, the share of responses sampled "
        "by more than one policy version (in-flight updates).",
    ]


def write_png(path: Path, results: list[dict], threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = grouped(results)
    shown = panels(groups)
    cols = min(2, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False, sharey=True)
    for ax, (condition, steps) in zip(axes.flat, shown):
        for arm, color in COLORS.items():
            runs = groups.get((condition, steps, arm), [])
            if runs:
                plot_arm(ax, runs, f"{arm} ({plural(len(runs), 'seed')})", color)
        ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{condition}, {steps} steps")
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("reward (trailing mean, 1/20 of the run)")
    fig.suptitle("Reward: mean over seeds, band ±1 std")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_arm(ax, runs: list[dict], label: str, color: str) -> None:
    curves = [r["series"]["reward/mean"] for r in runs]
    length = min(len(c) for c in curves)
    window = smoothing_window(length)
    smooth = [trailing_mean(c[:length], window) for c in curves]
    x = range(1, length + 1)
    mean = [statistics.mean(v) for v in zip(*smooth)]
    ax.plot(x, mean, color=color, label=label)
    if len(smooth) > 1:
        std = [statistics.stdev(v) for v in zip(*smooth)]
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=color, alpha=0.2, linewidth=0)  # fmt: skip


def report(out: Path, doc: Path, threshold: float) -> None:
    results = load_results(out)
    write_markdown(doc, results, threshold)
    write_png(doc.with_suffix(".png"), results, threshold)
    log.info("wrote %s and %s", doc, doc.with_suffix(".png"))


# --------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names_of(known: dict, what: str):
        def names(text: str) -> list[str]:
            found = [c.strip() for c in text.split(",") if c.strip()]
            if not found or any(c not in known for c in found):
                raise argparse.ArgumentTypeError(f"{text!r}: {what} are {', '.join(known)}")
            return found

        return names

    def seeds(text: str) -> list[int]:
        return [int(s) for s in text.split(",") if s.strip()]

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--conditions",
        type=names_of(CONDITIONS, "conditions"),
        default=list(CONDITIONS),
        help="comma-separated",
    )
    parser.add_argument(
        "--arms",
        type=names_of(ARMS, "arms"),
        default=list(ARMS),
        help=f"comma-separated, from {','.join(ARMS)}",
    )
    parser.add_argument("--seeds", type=seeds, default=[0, 1, 2], help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="RL steps per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (cores / jobs threads each)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the report (its PNG beside it)")
    parser.add_argument("--recipe", default=RECIPE, help="base recipe, relative to the repository")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="applied to every run"
    )
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="reward for 'steps to'")
    parser.add_argument("--report", action="store_true", help="only write the report from --out")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the runs' commands")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.jobs < 1 or not args.seeds:
        parser.error("--steps and --jobs must be >= 1, --seeds must name at least one seed")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    out, doc = args.out.resolve(), args.doc.resolve()
    if args.report:
        report(out, doc, args.threshold)
        return 0
    runs = plan_runs(args)
    if args.dry_run:
        for run in runs:
            log.info("%s: %s", run.name, shlex.join(run.command(out, run.in_process())))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed = run_all(runs, out, args.jobs)
    report(out, doc, args.threshold)
    if failed:
        log.error("%d run(s) failed; their logs are in %s (rerun to retry them)", failed, out / "logs")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
