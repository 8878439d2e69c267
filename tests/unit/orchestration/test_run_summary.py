"""The summary that ends a run: steps, wall time, rewards first → last and best, mean mismatch,
checkpoints and the commands to run next."""

from __future__ import annotations

from pathlib import Path

from moe_rl import run_dir as rd
from moe_rl.orchestration.metrics import run_summary


def _records(rewards: list[float]) -> list[dict]:
    return [{"step": i, "reward/mean": r, "old/kl_k3": 1e-6 * (i + 1)} for i, r in enumerate(rewards)]


def test_a_finished_run_reports_means_of_the_first_and_last_five_steps_and_what_to_run_next():
    rewards = [0.0] * 5 + [0.5] * 20 + [0.8, 0.6, 0.6, 0.6, 0.6]
    latest = Path("runs/tiny/checkpoints/step_000029")
    text = run_summary(
        _records(rewards), 30, 76.4, Path("runs/tiny"), [Path("runs/tiny/checkpoints/x"), latest]
    )
    lines = text.splitlines()
    assert lines[0] == "done: 30/30 steps in 1 min 16 s"
    assert "0.000 → 0.640 (mean of the first / last 5 steps), best 0.800 at step 25" in lines[1]
    assert "old/kl_k3 1.55e-05" in lines[2]  # mean of 1e-6 .. 30e-6
    assert lines[3].split() == ["checkpoints", "2,", "latest", str(latest)]
    commands = [line.split("    (")[0].strip().removeprefix("next").strip() for line in lines[4:]]
    assert commands == [
        "moe-rl report runs/tiny",
        "moe-rl export runs/tiny OUT",
        "moe-rl train runs/tiny/config.yaml --resume runs/tiny run.steps=60",
    ]


def test_a_stopped_run_offers_to_resume_the_remaining_steps():
    text = run_summary(_records([0.1, 0.3, 0.2]), 30, 3725, Path("my runs/a"), [])
    lines = text.splitlines()
    assert lines[0] == "stopped: 3/30 steps in 1 h 02 min"
    assert "0.100 → 0.200 (mean of the first / last 1 step), best 0.300 at step 1" in lines[1]
    assert lines[3].split() == ["checkpoints", "0"]
    assert (
        lines[-1].strip()
        == "moe-rl train 'my runs/a/config.yaml' --resume 'my runs/a'    (the remaining steps)"
    )


def test_a_run_stopped_before_its_first_step_still_says_how_to_go_on():
    lines = run_summary([], 30, 9.6, Path("runs/x"), []).splitlines()
    assert lines[0] == "stopped: 0/30 steps in 10 s"
    assert lines[1].split() == ["checkpoints", "0"]
    assert "--resume runs/x" in lines[-1]


def test_sealed_lists_checkpoints_with_a_manifest_oldest_first(tmp_path):
    folder = tmp_path / "checkpoints"
    for name, manifest in [("step_000010", True), ("step_000002", True), ("step_000011", False)]:
        (folder / name).mkdir(parents=True)
        if manifest:
            (folder / name / rd.MANIFEST).write_text("{}")
    (folder / "step_000001.unusable-20250101-000000").mkdir()
    (folder / "latest").write_text("step_000010")
    assert [p.name for p in rd.sealed(tmp_path)] == ["step_000002", "step_000010"]
    assert rd.sealed(tmp_path / "nothing") == []
    assert (folder / "step_000011").is_dir()  # listed or not, nothing is removed
