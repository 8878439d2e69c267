"""On-policy distillation on the tool task: a fresh student taught by a teacher trained on the task,
beside RL from scratch for the same steps; a student of half the width from the same teacher.

    python bench/distill_tools.py                  # the teacher once, every arm, seeds 0,1,2; the report
    python bench/distill_tools.py --seeds 0 --sft-steps 20 --rl-steps 5 --out bench/results/distill_smoke   # smoke
    python bench/distill_tools.py --arms distill --coef 0.3   # the students with another coef
    python bench/distill_tools.py --report         # only the report, from the results in --out

Task: `recipes/tiny_moe_tools.yaml` (a calculator tool for two-digit products; reward at most 1.5:
1 for the exact product, 0.5 for a call of the right value). The runs:

* the **teacher** (made once, seed `--teacher-seed`): `moe-rl sft` on `--demonstrations`
  demonstrations the calculator writes (`--sft-steps` steps: `tool_warm_start.run_sft`), then
  `moe-rl train` from it (`--init-from`, `trainer.lr` 5e-4, `--teacher-rl-steps` steps, default
  100): the ``sft`` arm of `bench/tool_warm_start.py`, in a run directory whose final checkpoint
  the students read;
* ``scratch``: RL from random weights, the tool recipe as shipped (`tool_warm_start.run_arm`);
* ``distill``: `recipes/tiny_moe_distill.yaml` (the tool recipe with ``algo.distill.coef`` and the
  ``teacher:`` section) from random weights, ``teacher.path`` the teacher's run directory;
* ``distill-half``: the same with a student of half the width, ``model.hidden_size`` 32 instead of
  64 (the recipe's other sizes stay: attention's 4 heads of 16 project from and to 32, the expert
  and dense FFNs keep their inner sizes; about half the parameters; the same vocabulary);
* ``distill-plain``: the ``distill`` student without the training–inference corrections (routing
  replay, keep-sampling-mask, IcePop, OPSM);
* ``distill-espo``: the ``distill`` student with the stability stack's objective (ESPO, sequence-mean
  aggregation) instead of the recipe's PPO-clip and token-mean.

Every student and scratch run is `--rl-steps` steps in the in-process loop
(`python -m moe_rl.orchestration.local`), one run at a time. ``--coef`` other than the recipe's
(1.0) names the arms ``distill@<coef>`` / ``distill-half@<coef>``, so several coefficients sit
side by side in one report. A finished run leaves `<out>/<arm>-seed<k>.json` (its per-step
series); runs with a result are skipped.

The report (`--write`, default docs/distill_tools.md) gives per arm and seed: the final reward
(mean ``reward/mean`` of the last 10 % of steps), the mean reward, ``distill/reverse_kl`` at the
first step and over the last 10 % of steps, the first step whose ``reward/mean`` reaches 1.0, and
the teacher's share of the step time (the sum of ``distill/teacher_s`` over the sum of
``time/step_s``); then mean ± std per arm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the tool task's SFT and scratch runners, their statistics

import tool_warm_start as tws  # noqa: E402

se = tws.se
log = logging.getLogger("distill_tools")

TOOLS = tws.RECIPE
DISTILL = "recipes/tiny_moe_distill.yaml"
RECIPE_COEF = 1.0
"""``algo.distill.coef`` of `recipes/tiny_moe_distill.yaml`."""
DEFAULT_OUT = REPO / "bench" / "results" / "distill_tools"
DEFAULT_DOC = REPO / "docs" / "distill_tools.md"
HALF = ("model.hidden_size=32",)
"""The half-width student's overrides (the recipe's hidden size is 64)."""
PLAIN = se.CORRECTIONS_OFF
"""The plain student's overrides: the recipe's PPO-clip and token-mean without the training–inference
corrections (routing replay, keep-sampling-mask, IcePop, OPSM)."""
ESPO = ("algo.objective=espo", "algo.aggregation=seq_mean_group_mean")
"""The stability stack's objective (ESPO, sequence-mean aggregation) instead of the recipe's."""
STUDENTS = {"distill": (), "distill-half": HALF, "distill-plain": PLAIN, "distill-espo": ESPO}
ARMS = ("scratch", *STUDENTS)
SERIES = (*tws.SERIES, "distill/reverse_kl", "distill/teacher_s", "train/loss")
TARGET = 1.0
"""The reward the students are asked to reach."""


def teacher_dir(out: Path, seed: int) -> Path:
    return out / "runs" / f"teacher-seed{seed}"


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def series_of(records: list[dict]) -> dict[str, list]:
    return {k: [r.get(k) for r in records] for k in SERIES if any(k in r for r in records)}


def result(
    arm: str, seed: int, steps: int, args: list[str], wall: float, cpu: float, records: list[dict]
) -> dict:
    return {
        "arm": arm, "seed": seed, "steps": steps, "command": " ".join(args), "wall_s": wall, "cpu_s": cpu,
        "commit": se.git_commit(), "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "series": series_of(records),
    }  # fmt: skip


def make_teacher(out: Path, seed: int, sft_steps: int, rl_steps: int, demonstrations: int) -> Path:
    """The teacher's run directory: SFT, then ``rl_steps`` RL steps from it through `moe-rl train`
    (0: the SFT run is the teacher); each run's series is kept as `<out>/teacher-sft-seed<k>.json`
    and `<out>/teacher-seed<k>.json`, and a run done already is not run again."""
    sft = tws.run_sft(out, seed, sft_steps, demonstrations)
    stored = out / f"teacher-sft-seed{seed}.json"
    if not stored.is_file():
        records = records_of(sft / "metrics.jsonl")
        stored.write_text(
            json.dumps(result("teacher-sft", seed, len(records), ["sft", TOOLS], 0.0, 0.0, records))
        )
    if rl_steps == 0:
        return sft
    run = teacher_dir(out, seed)
    stored = out / f"teacher-seed{seed}.json"
    final = run / "checkpoints" / f"step_{rl_steps - 1:06d}" / "manifest.json"
    if final.is_file():  # finished already
        if not stored.is_file():
            records = records_of(run / "metrics.jsonl")
            stored.write_text(
                json.dumps(result("teacher", seed, len(records), ["train", TOOLS], 0.0, 0.0, records))
            )
        log.info("teacher: done already (%s)", run)
        return run
    args = [
        TOOLS, "--force-new", "--init-from", str(sft), tws.SFT_LR, f"run.seed={seed}", f"run.steps={rl_steps}",
        f"run.output_dir={run.parent}", f"run.name={run.name}", "logging.progress=false",
    ]  # fmt: skip
    log_path = out / "logs" / f"{run.name}.log"
    with log_path.open("w") as err:
        code, wall, cpu = se.spawn([sys.executable, "-m", "launch.cli", "train", *args], err, err,
                                   se.thread_env(1, in_process=False))  # fmt: skip
    if code != 0:
        raise SystemExit(f"teacher: exit code {code} ({log_path})")
    records = records_of(run / "metrics.jsonl")
    found = result("teacher", seed, len(records), args, wall, cpu, records)
    stored.write_text(json.dumps(found))
    rewards = found["series"]["reward/mean"]
    log.info("teacher: %.0f s, final reward %.3f (%s)", wall, se.final_reward(rewards), run)
    return run


DEFAULT_RL_STEPS = 800
TEACHER_RL_STEPS = 100
"""The teacher's RL steps after its SFT (`--teacher-rl-steps`)."""


def arm_name(student: str, coef: float, steps: int = DEFAULT_RL_STEPS) -> str:
    """``student``, with ``@coef`` when not the recipe's and ``:steps`` when not the default."""
    coef_part = "" if coef == RECIPE_COEF else f"@{coef:g}"
    return student + coef_part + ("" if steps == DEFAULT_RL_STEPS else f":{steps}")


def run_name(arm: str, coef: float, steps: int) -> str:
    """The stored name of an arm's run: `arm_name`, a scratch run without a coefficient."""
    return arm_name(arm, RECIPE_COEF if arm == "scratch" else coef, steps)


def run_student(out: Path, student: str, coef: float, teacher: Path, seed: int, steps: int) -> dict:
    arm = arm_name(student, coef, steps)
    args = [
        DISTILL, f"teacher.path={teacher}", f"algo.distill.coef={coef}", f"run.seed={seed}", f"run.steps={steps}",
        "logging.progress=false", *STUDENTS[student],
    ]  # fmt: skip
    name = f"{arm}-seed{seed}"
    metrics, log_path = out / "runs" / "rl" / name / "metrics.jsonl", out / "logs" / f"{name}.log"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as err, metrics.open("w") as stdout:
        where = [f"run.output_dir={out / 'run_dirs' / 'rl'}", f"run.name={name}"]  # its checkpoints
        command = [sys.executable, "-m", "moe_rl.orchestration.local", "--force-new", *args, *where]
        code, wall, cpu = se.spawn(command, stdout, err, se.thread_env(1, in_process=True))
    if code != 0:
        raise RuntimeError(f"{name}: exit code {code} ({log_path})")
    return result(arm, seed, steps, args, wall, cpu, records_of(metrics))


# ------------------------------------------------------------------------------------- report
def values(series: dict, key: str) -> list[float]:
    return [v for v in series.get(key, []) if v is not None]


def run_numbers(series: dict) -> dict[str, float | None]:
    rewards = values(series, "reward/mean")
    kl = values(series, "distill/reverse_kl")
    teacher, step = values(series, "distill/teacher_s"), values(series, "time/step_s")
    return {
        "final": se.final_reward(rewards),
        "mean": sum(rewards) / len(rewards),
        "kl_first": kl[0] if kl else None,
        "kl_last": se.final_reward(kl) if kl else None,
        "reached": next((i + 1 for i, r in enumerate(rewards) if r >= TARGET), None),
        "teacher_share": sum(teacher) / sum(step) if teacher and step else None,
        "step_s": statistics.median(step) if step else None,
    }


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def cut_short(out: Path) -> list[dict]:
    """The runs that stopped before their end (no result stored): what their metrics hold."""
    found = []
    for metrics in sorted(out.glob("runs/rl/*/metrics.jsonl")):
        name = metrics.parent.name
        arm, _, seed = name.rpartition("-seed")
        records = records_of(metrics) if not (out / f"{name}.json").is_file() else []
        if records:
            found.append({**result(arm, int(seed), len(records), [], 0.0, 0.0, records), "cut_short": True})
    return found


def arm_order(results: list[dict]) -> list[str]:
    order = ["teacher-sft", "teacher", *ARMS]
    return sorted({r["arm"] for r in results}, key=lambda a: (order.index(a.split("@")[0].split(":")[0]), a))


def report(out: Path, doc: Path, args: argparse.Namespace) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    results += cut_short(out)
    if not results:
        raise SystemExit(f"no results in {out}")
    arms = arm_order(results)
    by_arm = {arm: sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"]) for arm in arms}
    students = [r for r in results if r["arm"] not in ("teacher-sft", "teacher", "scratch")]
    lines = [
        "# On-policy distillation on the tool task",
        "",
        "Regenerate (results in `bench/results/distill_tools/`) and this page:",
        "",
        "```bash",
        *commands(results, args, doc),
        "```",
        "",
        f"Report written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from {len(results)} runs at commit "
        f"{', '.join(sorted({r['commit'] for r in results}))}. The runs are described in "
        f"`bench/distill_tools.py`: the teacher is {teacher_words(by_arm)}; `scratch` is the "
        "tool recipe from random weights; the students are `recipes/tiny_moe_distill.yaml` from random "
        "weights with `teacher.path` the teacher's run directory (`distill-half`: `model.hidden_size=32`, "
        f"{params('half')} parameters against {params('full')}; `distill-plain`: without the training–inference "
        "corrections (routing replay, keep-sampling-mask, IcePop, OPSM); `distill-espo`: the stability stack's "
        "ESPO and sequence-mean aggregation instead of the recipe's PPO-clip and token-mean). Arms named `@c` ran "
        f"`algo.distill.coef=c` instead of the recipe's 1.0; `:n`, n RL steps instead of {DEFAULT_RL_STEPS}.",
        "",
        "| arm | seed | steps | final reward | mean reward | reverse KL first → last | first step reward ≥ 1.0 "
        "| teacher time share | step s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        for r in by_arm[arm]:
            n = run_numbers(r["series"])
            kl = (
                f"{fmt(n['kl_first'], '{:.3f}')} → {fmt(n['kl_last'], '{:.3f}')}"
                if n["kl_first"] is not None
                else "–"
            )
            reached = "not reached" if n["reached"] is None else str(n["reached"])
            steps = len(r["series"]["reward/mean"])
            steps = f"{steps} (cut short)" if r.get("cut_short") else str(steps)
            lines.append(
                f"| {arm} | {r['seed']} | {steps} | {n['final']:.3f} | {n['mean']:.3f} | {kl} | {reached} "
                f"| {fmt(n['teacher_share'], '{:.0%}')} | {fmt(n['step_s'], '{:.2f}')} |"
            )
    lines += [
        "",
        "Over seeds (mean ± std; runs cut short left out):",
        "",
        "| arm | seeds | final reward | seeds with final reward ≥ 1.0 | mean reward | reverse KL, last "
        "| teacher time share |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        found = [run_numbers(r["series"]) for r in by_arm[arm] if not r.get("cut_short")]
        if not found:
            continue

        def cell(key: str, spec: str, found=found) -> str:
            return se.mean_std([f[key] for f in found if f[key] is not None], spec)

        hits = sum(f["final"] >= TARGET for f in found)
        lines.append(
            f"| {arm} | {len(found)} | {cell('final', '{:.3f}')} | {hits}/{len(found)} | {cell('mean', '{:.3f}')} "
            f"| {cell('kl_last', '{:.3f}')} | {cell('teacher_share', '{:.2f}')} |"
        )
    lines += [
        "",
        "- **final reward**: mean `reward/mean` of the last 10 % of steps (at most 1.5: 1 for the exact product, "
        "0.5 for a call of the right value); **mean reward**: over the run.",
        "- **reverse KL first → last**: `distill/reverse_kl` (the mean of log π_student − log π_teacher over the "
        "batch's response tokens, on the student's samples) at the first step → the mean of the last 10 % of "
        "steps.",
        f"- **first step reward ≥ {TARGET}**: the first step (1-based) whose `reward/mean` reaches it.",
        "- **teacher time share**: the sum of `distill/teacher_s` (the teacher's forward and the distillation "
        "advantages) over the sum of `time/step_s`.",
        "",
    ]
    if args.reading:
        lines += ["## Reading", "", Path(args.reading).read_text().strip(), ""]
    elif doc.is_file() and "## Reading" in doc.read_text():  # keep the written reading on a re-report
        lines += ["## Reading", "", doc.read_text().split("## Reading", 1)[1].strip(), ""]
    doc.write_text("\n".join(lines))
    log.info("wrote %s (%d students)", doc, len(students))


def parse_arm(arm: str) -> tuple[str, float, int]:
    """`arm_name`'s inverse: (student or scratch, coef, steps)."""
    rest, _, steps = arm.partition(":")
    student, _, coef = rest.partition("@")
    return student, float(coef) if coef else RECIPE_COEF, int(steps) if steps else DEFAULT_RL_STEPS


def commands(results: list[dict], args: argparse.Namespace, doc: Path) -> list[str]:
    """Commands that run every stored student and scratch run (the first also makes the teacher),
    then the one that writes this report."""
    common = [f"--sft-steps {args.sft_steps}"] if args.sft_steps != 150 else []
    if args.teacher_rl_steps is not None:
        common.append(f"--teacher-rl-steps {args.teacher_rl_steps}")
    if args.demonstrations != 1024:
        common.append(f"--demonstrations {args.demonstrations}")
    seeds: dict[str, list[int]] = {}
    for r in sorted(results, key=lambda r: (r["finished"], r["seed"])):
        if r["arm"] not in ("teacher-sft", "teacher") and r["seed"] not in seeds.setdefault(r["arm"], []):
            seeds[r["arm"]].append(r["seed"])
    lines = []
    for arm, found in seeds.items():
        student, coef, steps = parse_arm(arm)
        words = [f"--arms {student}", f"--seeds {','.join(str(s) for s in sorted(found))}"]
        words += [f"--coef {coef:g}"] if coef != RECIPE_COEF else []
        words += [f"--rl-steps {steps}"] if steps != DEFAULT_RL_STEPS else []
        lines.append(" ".join(["python bench/distill_tools.py", *words, *common]))
    return [*lines, f"python bench/distill_tools.py --report --write {rel(doc)}"]


def teacher_words(by_arm: dict[str, list[dict]]) -> str:
    sft = "`moe-rl sft` on the calculator's demonstrations"
    if by_arm.get("teacher"):
        return (f"{sft} then RL from it (`trainer.lr` 5e-4), the `sft` arm of "
                "[tool_warm_start.md](tool_warm_start.md)")  # fmt: skip
    return f"{sft} (`teacher-sft`: its `reward/mean` is that of its fresh evaluation rollouts at each step)"


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def params(which: str) -> str:
    from moe_rl.config import load_recipe
    from moe_rl.planner.flops import count_params

    config = load_recipe(REPO / TOOLS, list(HALF) if which == "half" else [])
    return f"{count_params(config.model).total / 1e3:.0f} k"


# ------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--half-seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="seeds of distill-half (default: --seeds)")  # fmt: skip
    parser.add_argument("--teacher-seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rl-steps", type=int, default=DEFAULT_RL_STEPS)
    parser.add_argument("--demonstrations", type=int, default=1024)
    parser.add_argument("--teacher-rl-steps", type=int, default=None,
                        help=f"the teacher's RL steps after SFT (default {TEACHER_RL_STEPS}; 0: the SFT run teaches)")  # fmt: skip
    parser.add_argument("--coef", type=float, default=RECIPE_COEF, help="algo.distill.coef of the students")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"from {','.join(ARMS)}")
    parser.add_argument("--step-s", type=float, default=2.0, help="a step's seconds, for the time estimate")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--write", type=Path, default=DEFAULT_DOC, help="the report's path")
    parser.add_argument("--reading", help="a file whose text is the report's reading paragraph")
    parser.add_argument("--report", action="store_true", help="only the report, from the stored results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    args.out = args.out.resolve()
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "600")  # a loaded machine starts Ray slowly
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        arms = args.arms.split(",")
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
        half_seeds = args.half_seeds if args.half_seeds is not None else args.seeds
        todo = [  # seed by seed, so that a cut-short experiment has every arm
            (arm, seed)
            for seed in sorted({*args.seeds, *half_seeds})
            for arm in arms
            if seed in (half_seeds if arm == "distill-half" else args.seeds)
            and not (args.out / f"{run_name(arm, args.coef, args.rl_steps)}-seed{seed}.json").is_file()
        ]
        teacher_rl = TEACHER_RL_STEPS if args.teacher_rl_steps is None else args.teacher_rl_steps
        made = "teacher" if teacher_rl else "teacher-sft"
        teacher_todo = not (args.out / f"{made}-seed{args.teacher_seed}.json").is_file()
        steps = len(todo) * args.rl_steps + teacher_todo * (args.sft_steps + teacher_rl)
        log.info(
            "%d runs to do (%s), about %d steps: ~%.0f min at %.1f s a step", len(todo) + teacher_todo,
            ", ".join(f"{a}-seed{s}" for a, s in todo), steps, steps * args.step_s / 60, args.step_s,
        )  # fmt: skip
        teacher = make_teacher(args.out, args.teacher_seed, args.sft_steps, teacher_rl, args.demonstrations)
        failed = 0
        for arm, seed in todo:
            try:
                if arm == "scratch":
                    found = tws.run_arm(args.out, "scratch", seed, args.rl_steps, 1)
                    found["arm"] = run_name(arm, args.coef, args.rl_steps)
                else:
                    found = run_student(args.out, arm, args.coef, teacher, seed, args.rl_steps)
            except RuntimeError as exc:
                log.error("%s", exc)
                failed += 1
                continue
            (args.out / f"{found['arm']}-seed{seed}.json").write_text(json.dumps(found))
            n = run_numbers(found["series"])
            log.info("%s seed %d: %.0f s, final reward %.3f", found["arm"], seed, found["wall_s"], n["final"])
        if failed:
            return 1
    report(args.out, args.write, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
