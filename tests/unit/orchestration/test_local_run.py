"""The one-process loop as a command (`python -m moe_rl.orchestration.local`): the loop the recipe's
`run.mode` asks for (the choice `moe-rl train` makes, made in one place: `loop.run_loop`), in a run
directory taken as `moe-rl train` takes it, with its recipe, metrics and checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moe_rl.run_dir import checkpoints
from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[3]


def _main(args: list[str], capsys) -> tuple[int, list[dict], str]:
    from moe_rl.orchestration.local import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        code = main(args)
    finally:  # the command's terminal logging, taken off again
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_an_offline_recipe_runs_the_offline_loop_and_saves_its_run(tmp_path, capsys):
    """DGO's recipe: the starting policy generates the offline batches once (kept in the run
    directory), then the steps train epochs over them, each step's fresh rollouts only evaluated;
    checkpoints at `run.checkpoint_every` and after the last step, the metrics as the driver writes
    them. The same run directory again is refused in one line."""
    args = [
        str(REPO / "recipes" / "tiny_moe_dgo.yaml"), *TINY_MODEL_OVERRIDES, "run.steps=3",
        "run.checkpoint_every=2", "data.offline_batches=2", "rollout.batch_size=16",
        f"run.output_dir={tmp_path}", "run.name=dgo", "logging.tensorboard=false", "logging.progress=false",
    ]  # fmt: skip
    code, records, _ = _main(args, capsys)
    assert code == 0
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["offline/epoch"] for r in records] == [0, 0, 1]  # two stored batches a epoch
    assert all("reward/mean" in r and "offline/reward_mean" in r for r in records), records[0]
    run = tmp_path / "dgo"
    assert (run / "offline_data" / "complete").exists()
    assert sorted(step for step, _ in checkpoints(run)) == [1, 2]
    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert written == records
    assert "mode: offline" in (run / "config.yaml").read_text()
    code, records, err = _main(args, capsys)
    assert (code, records) == (2, [])
    assert err.startswith(f"error: run directory {run} already holds a run (checkpoints of steps [1, 2])")
    assert len(err.splitlines()) == 1


def test_an_offline_run_without_a_run_directory_is_told_where_its_data_would_go():
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    config = load_checked(REPO / "recipes" / "tiny_moe_dgo.yaml", [*TINY_MODEL_OVERRIDES, "run.steps=1"])
    with pytest.raises(ValueError, match="keeps the data it generates in its run directory"):
        next(LocalRun(config).run())
