"""bench/stack_effect.py: every condition and arm validates, runs of different lengths stay apart,
and the report splits them (no run starts here)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def se():
    spec = importlib.util.spec_from_file_location("stack_effect_bench", REPO / "bench" / "stack_effect.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_condition_and_arm_validates(se):
    args = se.parse_args(["--steps", "300", "--seeds", "0"])
    runs = se.plan_runs(args)
    assert len(runs) == len(se.CONDITIONS) * len(se.ARMS)
    for run in runs:
        config = run.config()  # a recipe that does not validate stops the experiment: SystemExit
        assert config.run.steps == 300
    bypass = [r for r in runs if r.condition.name == "bypass_truncation"]
    assert {r.config().algo.policy_mode.value for r in bypass} == {"bypass"}
    assert {r.config().rollout.top_p for r in bypass} == {0.7}


def test_arms_are_chosen_and_checked(se):
    args = se.parse_args(["--conditions", "bypass_truncation", "--arms", "off,corrections", "--seeds", "1"])
    assert [r.arm for r in se.plan_runs(args)] == ["off", "corrections"]
    with pytest.raises(SystemExit):
        se.parse_args(["--arms", "off,nope"])


def test_run_lengths_are_kept_apart(se, tmp_path):
    reference = se.CONDITIONS["reference"]
    short, long = (se.Run(reference, "off", 0, steps, se.RECIPE) for steps in (100, 300))
    assert short.name != long.name and short.name.endswith("-100steps")

    def result(run, rewards):
        series = {"reward/mean": rewards, "time/step_s": [0.1] * len(rewards)}
        return {
            "name": run.name, "condition": run.condition.name, "arm": run.arm, "seed": run.seed,
            "steps": run.steps, "settings": run.settings(), "extra": [], "stack": "s", "runner": "local",
            "jobs": 2, "threads": "1", "cpus": 2, "commit": "c", "wall_s": 1.0, "cpu_s": 1.0, "startup_s": 0.5,
            "finished": "2026-01-01T00:00:00+00:00", "series": series,
        }  # fmt: skip

    results = [
        result(se.Run(reference, arm, seed, steps, se.RECIPE), [0.1 * (arm == "on")] * steps)
        for steps in (100, 300)
        for arm in ("off", "on")
        for seed in (0, 1)
    ]
    for r in results:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    assert results[4]["name"] == long.name
    (tmp_path / f"{long.name}.json").unlink()  # a 300-step run to do; its 100-step twin is stored
    assert se.pending([short, long], tmp_path) == [long]
    (tmp_path / f"{long.name}.json").write_text(json.dumps(results[4]))
    doc = tmp_path / "report.md"
    se.report(tmp_path, doc, 0.5)
    text = doc.read_text()
    commands = [
        line for line in text.splitlines() if line.startswith("python bench/stack_effect.py --conditions")
    ]
    assert len(commands) == 2 and "--steps 100" in commands[0] and "--steps 300" in commands[1]
    assert "--arms off,on" in commands[0]
    assert "| reference | 100 | off | 2 |" in text and "| reference | 300 | on | 2 |" in text
    paired = [line for line in text.splitlines() if "| on − off |" in line]
    assert len(paired) == 2 and all("+0.100" in line for line in paired)
    assert doc.with_suffix(".png").stat().st_size > 0
