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


def test_tiny_run_learns_and_writes_every_metric(tmp_path):
    _finish(_train([TINY, "run.name=learn"], tmp_path))
    run_dir = tmp_path / "learn"
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(30))
    for field in REQUIRED_FIELDS:
        assert all(field in r for r in records), f"metrics.jsonl lacks {field}"
    first = sum(r["reward/mean"] for r in records[:5]) / 5
    last = sum(r["reward/mean"] for r in records[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first five {first:.3f}, last five {last:.3f}"
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000029"
    assert records[0]["quant/recipe"] == "fp8_block128" and records[0]["quant/rel_err"] > 0


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "sync/seconds"))}


SCALED_OUT = ["parallel.trainer_world_size=2", "rollout.num_engines=2"]


@pytest.mark.parametrize(
    ("sig", "layout"),
    [(signal.SIGINT, SCALED_OUT), (signal.SIGTERM, [])],
    ids=["ctrl-c-dp2-two-engines", "sigterm-one-rank"],
)
def test_interrupt_saves_and_resume_equals_an_uninterrupted_run(tmp_path, sig, layout):
    """Interrupted, then its newest checkpoint damaged (truncated / 4 KiB overwritten), `latest`
    deleted and a torn line left in metrics.jsonl: the resume falls back to the checkpoint before,
    refuses a second run in the same directory meanwhile, and ends equal to an uninterrupted run."""
    common = [TINY, "run.steps=6", *layout]
    straight = _train([*common, "run.name=straight"], tmp_path)
    _finish(straight)
    reference = _metrics(tmp_path / "straight")

    interrupted = _train([*common, "run.name=cut", "run.checkpoint_every=1"], tmp_path)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert interrupted.poll() is None, interrupted.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)
    interrupted.send_signal(sig)  # the step in flight finishes, then a consistent checkpoint
    out, _ = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 130, out[-3000:]
    checkpoints = tmp_path / "cut" / "checkpoints"
    newest = checkpoints / (checkpoints / "latest").read_text()
    _damage(newest, truncate=sig == signal.SIGINT)
    (checkpoints / "latest").unlink()
    with metrics.open("a") as f:
        f.write('{"step": 9, "reward/me')  # a write cut short

    resume = _train([TINY, "--resume", str(tmp_path / "cut"), *layout], tmp_path)
    lock = tmp_path / "cut" / "run.lock"
    while not (lock.exists() and lock.read_text()):
        assert resume.poll() is None, resume.communicate()[0][-3000:]
        time.sleep(0.1)
    second = _train([TINY, "--resume", str(tmp_path / "cut")], tmp_path)
    out2, _ = second.communicate(timeout=120)
    assert second.returncode == 2 and f"is in use by pid {resume.pid} " in out2, out2[-2000:]
    out = _finish(resume)
    assert f"checkpoint {newest.name} is not usable" in out and "resuming from the older" in out, out[-3000:]
    assert "is incomplete (a write cut short); dropped" in out
    resumed = _metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == list(range(6))
    for a, b in zip(reference, resumed):
        assert _comparable(a) == _comparable(b), f"step {a['step']} differs after resume"


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


def test_engine_crash_is_detected_and_the_engine_restarted(tmp_path):
    proc = _train(
        [TINY, "run.steps=6", "run.name=crash", "logging.diagnose_every=3"], tmp_path, start_new_session=True
    )
    metrics = tmp_path / "crash" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    pids = subprocess.run(["pgrep", "-f", "ray::EngineActor"], capture_output=True, text=True).stdout.split()
    assert pids, "no engine actor process found"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    _finish(proc)
    records = _metrics(tmp_path / "crash")
    assert [r["step"] for r in records] == list(range(6))
    assert records[-1]["rollout/engine_restarts"] >= 1
    # the mismatch probe ran every third step, with R3 replaying the engine's routing exactly
    probed = [r["step"] for r in records if "probe/kl_k3" in r]
    assert probed == [2, 5]
    assert all(records[s]["probe/routing_agreement"] == 1.0 for s in probed)


@pytest.mark.parametrize(
    ("max_staleness", "expect_rejections", "engines", "shaping"),
    [(1, False, 2, True), (0, True, 1, False)],
    ids=["eta-1-accepts-two-engines-zvp", "eta-0-rejects"],
)
def test_async_one_step_off_policy_respects_the_staleness_bound(
    tmp_path, max_staleness, expect_rejections, engines, shaping
):
    """Async with a staleness bound; the η=1 run also shapes zero-variance groups (RL-ZVP)."""
    name = f"async{max_staleness}"
    args = [TINY, "run.steps=4", "run.mode=async", f"run.max_staleness={max_staleness}", f"run.name={name}"]
    args += [f"rollout.num_engines={engines}", f"algo.zero_variance_shaping={str(shaping).lower()}"]
    _finish(_train(args, tmp_path))
    records = _metrics(tmp_path / name)
    if shaping:  # tokens were entropy-shaped exactly in the steps that had zero-variance groups
        assert any(r["advantage/zero_variance_groups"] > 0 for r in records)
        for r in records:
            assert (r["old/zvp_token_share"] > 0) == (r["advantage/zero_variance_groups"] > 0), r["step"]
            assert r["old/zvp_token_share"] <= 1 and math.isfinite(r["train/loss"])
    else:
        assert not any("old/zvp_token_share" in r for r in records)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    staleness = [r["policy/staleness"] for r in records]
    rejected = records[-1]["rollout/stale_rejected_samples"]
    if expect_rejections:
        # every overlapped batch was one version old: rejected, counted, regenerated on-policy
        assert staleness == [0, 0, 0, 0] and rejected == 3 * 64
    else:
        # batches after the first were generated while the previous step trained
        assert staleness == [0, 1, 1, 1] and rejected == 0
    assert all(s <= max_staleness for s in staleness)
    assert all(r["rollout/engines"] == engines for r in records)


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
    assert re.search(r"reward function data.reward=bad_reward:score raised KeyError: '(\d)' \(response .*, "
                     r"answer '\1'\) \(traceback: .*train.log\)$", line), line  # fmt: skip
    log_file = tmp_path / "badreward" / "logs" / "train.log"
    assert "Traceback" in log_file.read_text() and "KeyError" in log_file.read_text()
