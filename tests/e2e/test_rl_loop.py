"""The RL loop end to end on the tiny MoE, through the real `moe-rl train` command (Ray actors,
Megatron trainer, Megatron engine with fp8_block128 fake quantization, the stability stack)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.orchestration.metrics import repeatable
from tests.e2e.runs import LEARN_STEPS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny_moe.yaml"

# Every field a step record must carry (issue-level contract of metrics.jsonl).
REQUIRED_FIELDS = [
    "step",
    "reward/mean",
    "response/length_mean",
    "policy/version",
    "old/kl_k1",
    "old/kl_k3",
    "old/chi2_token",
    "old/chi2_seq",
    "old/ess_token",
    "old/ppl_ratio",
    "old/prob_pearson",
    "old/prob_abs_diff_max",
    "old/prob_abs_diff_mean",
    "old/routing_agreement",
    "train/icepop_masked_frac",
    "train/opsm_masked_seq_frac",
    "train/clip_frac",
    "train/grad_norm",
    "train/routing_agreement",
    "advantage/zero_variance_groups",
    "quant/rel_err",
    "time/rollout_s",
    "time/reward_s",
    "time/old_logp_s",
    "time/train_s",
    "time/sync_s",
    "time/step_s",
    "perf/tflops",
    "perf/mfu",
]


def _train(args: list[str], tmp_path: Path, **popen) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "train",
        *args,
        f"run.output_dir={tmp_path}",
        "logging.progress=false",
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# What library output looks like on a terminal; none of it may reach the terminal of a run at the
# default log level (it goes to <run dir>/logs/). Each pattern is checked against real lines first.
LIBRARY_LINES = {
    "a library's logger": re.compile(r"\b\d\d:\d\d:\d\d [DIWEC] (?!moe_rl|launch)[\w.]+: "),
    "Ray's log format": re.compile(r"\t(DEBUG|INFO|WARNING|ERROR) [\w.]+\.py:\d+ -- "),
    "vLLM's log format": re.compile(r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \["),
    "a Python warning": re.compile(r"\w+Warning: |^\S*\s*_?warnings\.warn\(|site-packages/"),
    "Megatron's bucket listing": re.compile(r"Params for bucket|^\S*\s*\t(decoder|embedding|output_layer)\."),
    "an actor's output other than a project warning or error": re.compile(
        r"\(\w+ pid=\d+\)(?! \d\d:\d\d:\d\d [WE] (moe_rl|launch)[\w.]*: )"
    ),
    "a ModelOpt, vLLM or Triton notice": re.compile(r"\b(modelopt|vllm|triton)\b", re.IGNORECASE),
}
PROJECT_LINE = re.compile(r"^\d\d:\d\d:\d\d [DIWEC] (moe_rl|launch)[\w.]*: ")
SEEN_BEFORE = [  # as a tiny run printed them before they went to the log files
    "2026-11-23 18:20:23,341\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled "
    "for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
    "2026-11-23 18:20:32,309\tINFO worker.py:2038 -- Started a local Ray instance.",
    "\x1b[36m(TrainerRank pid=14169)\x1b[0m 18:20:39 I megatron.core.distributed.fsdp.src.megatron_fsdp."
    "mixed_precision: Using Megatron-FSDP without Transformer Engine.",
    "\x1b[36m(TrainerRank pid=14169)\x1b[0m /venv/lib/python3.11/site-packages/megatron/core/optimizer/"
    "__init__.py:24: UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "\x1b[36m(EngineActor pid=14358)\x1b[0m   warnings.warn(",
    "\x1b[36m(TrainerRank pid=14169)\x1b[0m Params for bucket 1 (224640 elements, 224640 padded size):",
    "\x1b[36m(TrainerRank pid=14169)\x1b[0m \tdecoder.layers.1.mlp.experts.local_experts.4.linear_fc2.weight",
    "\x1b[36m(TrainerRank pid=14169)\x1b[0m 18:20:55 I moe_rl.trainer.worker: saved checkpoint of step 6",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "INFO 11-23 18:20:23 [importing.py:44] Triton not installed or not compatible",
    "/venv/lib/python3.11/site-packages/modelopt/torch/__init__.py:55: UserWarning: transformers 5.19.0 is not "
    "tested with current version of modelopt and may cause issues.",
    "  _warnings.warn(",
    "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/planner_helpers.py:489: FutureWarning: "
    "Please use DTensor instead and we are deprecating ShardedTensor.",
]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _library_line(line: str) -> str | None:
    """Which kind of library output ``line`` is (None: the project's, or none recognized)."""
    line = ANSI.sub("", line)
    if PROJECT_LINE.match(line):
        return None
    return next((kind for kind, pattern in LIBRARY_LINES.items() if pattern.search(line)), None)


def _check_terminal(out: str, run_dir: Path, records: list[dict]) -> None:
    """Quiet by default: no library output, one line per step, the summary; the libraries' output
    went to the log files (the driver's and one per actor)."""
    assert [line for line in SEEN_BEFORE if not _library_line(line)] == []
    noise = [f"{kind}: {line}" for line in out.splitlines() if (kind := _library_line(line))]
    assert not noise, "\n".join(noise[:20])
    steps = [int(m.group(1)) for m in re.finditer(r" I moe_rl\.metrics: step (\d+) \| reward ", out)]
    assert steps == list(range(LEARN_STEPS)), out[-4000:]
    k = max(1, min(5, len(records) // 5))  # the summary's window: a fifth of the steps, 1 to 5
    first, last = (sum(r["reward/mean"] for r in part) / k for part in (records[:k], records[-k:]))
    kl = sum(r["old/kl_k3"] for r in records) / len(records)
    done = f" I moe_rl.driver: done: {LEARN_STEPS}/{LEARN_STEPS} steps in "
    assert done in out, out[-3000:]
    summary = out[out.index(done) :]
    assert f" {first:.3f} → {last:.3f} (mean of the first / last {k} steps)" in summary, summary
    assert (
        f"old/kl_k3 {kl:.2e}" in summary
        and f"checkpoints  1, latest {run_dir}/checkpoints/step_{LEARN_STEPS - 1:06d}" in summary
    )
    for command in (
        f"moe-rl report {run_dir}",
        f"moe-rl export {run_dir} OUT",
        f"--resume {run_dir} run.steps={2 * LEARN_STEPS}",
    ):
        assert command in summary, summary
    logs = run_dir / "logs"
    assert re.search(r" [IW] ray\.", (logs / "train.log").read_text())
    for actor in ("trainer0", "engine0"):
        text = (logs / f"{actor}.log").read_text()
        assert (
            " I megatron.core." in text
            and "UserWarning: Transformer Engine and Apex are not installed" in text
        )


def test_tiny_run_learns_and_writes_every_metric(learned_run):
    """The README's command (`learned_run`): the run starts a Ray cluster of its own."""
    out, run_dir = learned_run.out, learned_run.path
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(LEARN_STEPS))
    for field in REQUIRED_FIELDS:
        assert all(field in r for r in records), f"metrics.jsonl lacks {field}"
    first = sum(r["reward/mean"] for r in records[:5]) / 5
    last = sum(r["reward/mean"] for r in records[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first five {first:.3f}, last five {last:.3f}"
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{LEARN_STEPS - 1:06d}"
    assert records[0]["quant/recipe"] == "fp8_block128" and records[0]["quant/rel_err"] > 0
    _check_terminal(out, run_dir, records)


LAYOUT = [
    "parallel.trainer_world_size=2", "rollout.num_engines=2",
    "algo.advantage=gae", "rollout.group_size=1", "critic.lr=5e-3",
]  # fmt: skip
"""Two trainer ranks and two engines, PPO with a critic: the resume restores the critic's weights,
optimizer and step too. SIGTERM (`scancel`, preemption) takes the same path as Ctrl-C
(tests/unit/orchestration/test_reward_phase.py)."""


def test_interrupt_saves_and_resume_equals_an_uninterrupted_run_whose_engines_crashed(tmp_path):
    """The uninterrupted run loses both engine processes (killed) after its first step: the crash is
    detected, the engines are restarted and brought to the weights, and the run goes on; the mismatch
    probe runs every third step, with R3 replaying the engine's routing exactly.

    The other run, interrupted by Ctrl-C, then its newest checkpoint cut short and the one before it
    damaged in place (4 KiB overwritten, same size), `latest` deleted and a torn line left in
    metrics.jsonl: the resume falls back to the checkpoint before both, refuses a second run in the
    same directory meanwhile (even after its run.lock was deleted: the directory itself is locked,
    and the run writes its note again), and ends equal to the first run, its metrics one run's, in
    order: neither the crash nor the interruption changed a step."""
    common = [TINY, "run.steps=6", "logging.diagnose_every=3", *LAYOUT]
    tag = f"crash-{os.getpid()}-{time.monotonic_ns()}"
    straight = _train(
        [*common, "run.name=straight"],
        tmp_path,
        start_new_session=True,
        env={**os.environ, "MOE_RL_TEST_TAG": tag},
    )
    _wait_for_steps(straight, tmp_path / "straight" / "metrics.jsonl", 1)
    pids = _engines_of(tag)
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _finish(straight)
    reference = _metrics(tmp_path / "straight")
    assert "critic/loss" in reference[0] and reference[0]["trainer/world_size"] == 2
    assert [r["step"] for r in reference] == list(range(6)) and reference[-1]["rollout/engine_restarts"] >= 1
    probed = [r["step"] for r in reference if "probe/kl_k3" in r]
    assert probed == [2, 5]
    assert all(reference[s]["probe/routing_agreement"] == 1.0 for s in probed)

    interrupted = _train([*common, "run.name=cut", "run.checkpoint_every=1"], tmp_path)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    _wait_for_steps(interrupted, metrics, 3)
    interrupted.send_signal(signal.SIGINT)  # the step in flight finishes, then a consistent checkpoint
    out, _ = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 130, out[-3000:]
    checkpoints = tmp_path / "cut" / "checkpoints"
    newest = checkpoints / (checkpoints / "latest").read_text()
    saved = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert saved[-1] == newest and len(saved) >= 3, saved
    _damage(newest, truncate=True)
    _damage(saved[-2], truncate=False)
    (checkpoints / "latest").unlink()
    with metrics.open("a") as f:
        f.write('{"step": 9, "reward/me')  # a write cut short

    resume = _train([TINY, "--resume", str(tmp_path / "cut"), *LAYOUT], tmp_path)
    lock = tmp_path / "cut" / "run.lock"
    deadline = time.monotonic() + 300
    while not (lock.exists() and lock.read_text()):
        assert resume.poll() is None, resume.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the resumed run never took its lock"
        time.sleep(0.1)
    lock.unlink()
    second = _train([TINY, "--resume", str(tmp_path / "cut")], tmp_path)
    out2, _ = second.communicate(timeout=120)
    # the note may be written again before the second run reads it
    owners = ["another process (its run.lock was removed)", f"pid {resume.pid} "]
    assert second.returncode == 2 and any(f"is in use by {o}" in out2 for o in owners), out2[-2000:]
    out = _finish(resume)
    assert "run.lock was removed or changed; this run" in out, out[-3000:]
    for damaged in (newest, saved[-2]):
        assert f"checkpoint {damaged.name} is not usable" in out, out[-3000:]
    assert f"resuming from the older {saved[-3].name}" in out, out[-3000:]
    assert "is incomplete (a write cut short); dropped" in out
    resumed = _metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == list(range(6)) and resumed[-1]["rollout/engine_restarts"] == 0
    for a, b in zip(reference, resumed, strict=True):
        assert repeatable(a, CRASH_KEYS) == repeatable(b, CRASH_KEYS), (
            f"step {a['step']} differs after resume"
        )


CRASH_KEYS = ("rollout/engine_restarts", "rollout/regenerated_prompts")
"""What the engines' crash changes in the uninterrupted run's records by construction."""


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int) -> None:
    """Until the run ``proc`` logged ``steps`` steps in ``metrics``."""
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


def _damage(checkpoint: Path, truncate: bool) -> None:
    """Cut the checkpoint's largest file in half, or overwrite 4 KiB in its middle (same size)."""
    largest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    assert len(data) > 8192, largest
    if truncate:
        largest.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        largest.write_bytes(data[:middle] + bytes(4096) + data[middle + 4096 :])


def _engines_of(tag: str) -> list[int]:
    """The engine actor processes of the run started with ``MOE_RL_TEST_TAG=tag`` (its Ray cluster's
    processes inherit the driver's environment), never those of another run on the machine."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # not a process, or gone
            continue
        if f"MOE_RL_TEST_TAG={tag}".encode() in environ and cmdline.startswith(b"ray::EngineActor"):
            found.append(int(entry.name))
    return found


def test_async_with_inflight_updates_respects_the_staleness_bound(async_run):
    """Async two steps ahead with staleness bound 2, in-flight weight updates and two engines,
    shaping zero-variance groups (RL-ZVP): every batch after the first is generated while earlier
    steps train, at most two versions behind; the engines take each sync in a concurrency group of
    their own, beside a generation, and none is rejected. (A bound below the depth would reject
    every batch: the preflight refuses it, tests/unit/config/test_bad_values.py; how far behind the
    batches are without in-flight updates: tests/unit/orchestration/test_async_depth.py.) The run
    is `async_run` (tests/e2e/conftest.py), which `moe-rl report` reads too."""
    records = _metrics(async_run)
    # tokens were entropy-shaped exactly in the steps that had zero-variance groups
    assert any(r["advantage/zero_variance_groups"] > 0 for r in records)
    for r in records:
        assert (r["old/zvp_token_share"] > 0) == (r["advantage/zero_variance_groups"] > 0), r["step"]
        assert r["old/zvp_token_share"] <= 1 and math.isfinite(r["train/loss"])
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    staleness = [r["policy/staleness"] for r in records]
    assert staleness[:2] == [0, 1] and all(1 <= s <= 2 for s in staleness[2:]), staleness
    assert all(0 <= r["rollout/mixed_version_share"] <= 1 for r in records)
    assert records[-1]["rollout/stale_rejected_samples"] == 0
    assert all(r["rollout/engines"] == 2 for r in records)


def test_a_failing_reward_function_stops_the_run_with_one_line(tmp_path):
    """A user's reward function that raises, on the reward worker (a Ray actor): the driver prints
    one line naming the function, the exception and the input; the traceback is in logs/train.log."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "bad_reward.py").write_text(
        "def score(response, answer):\n    return {'reward': 1}[answer]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = [TINY, "run.name=badreward", "run.steps=2", f"data.task=file:{data}", "data.reward=bad_reward:score",
            "model.vocab_size=320", "rollout.batch_size=16"]  # fmt: skip
    proc = _train(args, tmp_path, env=env)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if " E moe_rl" in x or " E launch" in x]
    assert re.search(r"reward function data.reward=bad_reward:score raised KeyError: '(\d)' \(prompt \d+, "
                     r"response .*, answer '\1'\) \(traceback: .*train.log\)$", line), line  # fmt: skip
    log_file = tmp_path / "badreward" / "logs" / "train.log"
    assert "Traceback" in log_file.read_text() and "KeyError" in log_file.read_text()
