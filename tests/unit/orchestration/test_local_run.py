"""The one-process loop as a command (`python -m moe_rl.orchestration.local`): the loop the recipe's
`run.mode` asks for (the choice `moe-rl train` makes, made in one place: `loop.run_loop`), in a run
directory taken as `moe-rl train` takes it, with its recipe, metrics and checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moe_rl import run_dir as rd
from moe_rl.config import load_recipe
from moe_rl.config.modes import SyncRoute
from moe_rl.run_dir import checkpoints, read_metrics
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
    assert all("old/kl_k3" in r for r in records)  # DGO's data came from a sampling policy: its drift
    run = tmp_path / "dgo"
    assert (run / "offline_data" / "complete").exists()
    assert sorted(step for step, _ in checkpoints(run)) == [1, 2]
    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert written == records
    written = load_recipe(run / "config.yaml")
    assert written.run.mode == "offline" and written.model.vocab_size == 64  # every override in it
    code, records, err = _main(args, capsys)
    assert (code, records) == (2, [])
    assert err.startswith(f"error: run directory {run} already holds a run (checkpoints of steps [1, 2])")
    assert len(err.splitlines()) == 1
    code, records, _ = _main(["--force-new", *args[:-4], "run.steps=1", *args[-4:]], capsys)
    assert (code, [r["step"] for r in records]) == (0, [0])  # the run started over
    assert sorted(step for step, _ in checkpoints(run)) == [0]


def test_the_command_reads_its_recipe_and_overrides_from_its_command_line():
    """As a command (`sys.argv`): a bad override is one line naming it, exit code 2."""
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "moe_rl.orchestration.local",
        str(REPO / "recipes" / "tiny_moe.yaml"),
        "run.steps=0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: ") and "run.steps=0 must be > 0" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("args", [[], ["--force-new"], ["-x", "recipes/tiny_moe.yaml"]])
def test_a_command_line_without_a_recipe_is_told_its_usage(args, capsys):
    from moe_rl.orchestration.local import USAGE, main

    assert main(args) == 2
    assert capsys.readouterr().err == USAGE


def test_a_run_of_fewer_steps_than_the_recipes_stops_there_offline_too(tmp_path):
    """`LocalRun.run(n)` and `LocalRun.step(i)` take the recipe's loop (offline here) up to where
    they are asked, not to `run.steps`."""
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    overrides = [*TINY_MODEL_OVERRIDES, "run.steps=4", "data.offline_batches=1", "rollout.batch_size=16"]
    local = LocalRun(load_checked(REPO / "recipes" / "tiny_moe_dgo.yaml", overrides), run_dir=tmp_path)
    assert [r["step"] for r in local.run(2)] == [0, 1]
    record = local.step(2)
    assert record["step"] == 2 and record["offline/epoch"] == 2


def test_an_sft_step_reports_no_drift_and_no_stored_reward(tmp_path):
    """``algo.objective=sft`` trains the stored batch with every weight 1 and reports neither a drift
    from a sampling policy (``old/*``) nor the batch's stored reward: it names none; DGO's step, from
    the same recipe, reports both (`test_an_offline_recipe_runs_the_offline_loop_and_saves_its_run`)."""
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    overrides = [
        *TINY_MODEL_OVERRIDES,
        "algo.objective=sft",
        "data.offline_batches=1",
        "rollout.batch_size=16",
    ]
    local = LocalRun(load_checked(REPO / "recipes" / "tiny_moe_dgo.yaml", overrides), run_dir=tmp_path)
    record = local.step(0)
    assert not [key for key in record if key.startswith(("old/", "offline/reward"))], sorted(record)
    assert record["offline/epoch"] == 0 and record["train/loss"] > 0 and "reward/mean" in record
    assert "time/old_logp_s" in record  # the π_old pass ran; only its drift is not reported
    local.job.shutdown()


def test_an_offline_run_without_a_run_directory_is_told_where_its_data_would_go():
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    config = load_checked(REPO / "recipes" / "tiny_moe_dgo.yaml", [*TINY_MODEL_OVERRIDES, "run.steps=1"])
    with pytest.raises(ValueError, match="keeps the data it generates in its run directory"):
        next(LocalRun(config).run())


def test_a_colocated_step_that_releases_memory_reports_each_phase_once_and_its_rounds_counts():
    """``cluster.release_memory=on``: the trainer releases before the generation and the engine
    sleeps after it, once each a step, as the stages report them; the step's rounds count what they
    did (no prompt generated again, the reward worker's time apart from the generation's); a
    generation's status names the replica it is kept under."""
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.orchestration.sampling import Draw, Purpose

    config = load_checked(
        REPO / "recipes" / "tiny_moe.yaml",
        [*TINY_MODEL_OVERRIDES, "cluster.release_memory=on", "rollout.batch_size=8", "rollout.group_size=4",
         "logging.diagnose_every=1"],
    )  # fmt: skip
    local = LocalRun(config)
    assert local.stages.workers.plan.releases_memory
    assert local.stages.workers.plan.sync.route == SyncRoute.IN_PROCESS  # one process: no transport
    record = local.step(0)
    assert record["probe/kl_k3"] >= 0 and record["mismatch/staleness"] == 0.0  # the probe, on a sync step
    assert record["memory/trainer_releases"] == record["memory/engine_sleeps"] == 1
    assert record["rollout/regenerated_prompts"] == record["rollout/engine_restarts"] == 0
    phases = ("time/rollout_s", "time/reward_s", "time/old_logp_s", "time/train_s", "time/sync_s")
    assert all(record[k] >= 0 for k in phases) and sum(record[k] for k in phases) <= record["time/step_s"]
    rounds = local.stages.generate(1)
    assert rounds.metrics() == {"rollout/regenerated_prompts": 0, "time/reward_s": 0.0}  # none scored yet
    engines = local.stages.engines
    gen = engines.generate(rounds.prompts, Draw(Purpose.EVAL, 1), [0, 1])
    assert sorted(gen.statuses) == [r.index for r in engines.replicas]
    assert all(status["replica"] == index for index, status in gen.statuses.items())
    from moe_rl.weight_sync.protocol import SyncTarget, TransferStart

    for into in SyncTarget:  # neither receiver of a Megatron engine's process takes vLLM's transfer
        with pytest.raises(TypeError, match=f"the {into} of this engine process .* takes buckets, not vLLM's "
                           "weight transfer; it was sent start_weight_update"):  # fmt: skip
            engines.host.receive(TransferStart(), into)
    local.job.shutdown()


def test_a_run_restored_from_its_checkpoint_goes_on_at_the_step_after_it(tmp_path, caplog):
    """A one-process run of four steps checkpointed every three (after step 2, and after its last),
    then a new run on its directory restored from the newest checkpoint: it starts at step 4 with
    the policy version and prompt stream the checkpoint holds, and says so."""
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.metrics import MetricsSink
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.run_dir import newest_usable

    config = load_checked(
        REPO / "recipes" / "tiny_moe.yaml",
        [*TINY_MODEL_OVERRIDES, "run.steps=5", "run.checkpoint_every=3", "rollout.batch_size=8",
         "rollout.group_size=4"],
    )  # fmt: skip
    first = LocalRun(config, run_dir=tmp_path)
    first.job.checkpoint()  # no step done: nothing to save (a trainer state before any update)
    assert not (tmp_path / "checkpoints").exists()
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)  # a save cut short, never sealed
    sink = MetricsSink(tmp_path, tensorboard=False)
    records = []
    for record in first.run(4):
        records.append(record)
        sink.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    sink.log(4, {"reward/mean": 0.5})  # a step logged after the last checkpoint, never saved
    sink.close()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["policy/version"] for r in records] == [0, 1, 2, 3]  # each batch of the weights it trains
    assert sorted(step for step, _ in checkpoints(tmp_path)) == [2, 3]
    stream = first.stages.source.state()
    first.job.shutdown()
    usable = newest_usable(tmp_path)
    assert usable is not None and usable.path.name == "step_000003"
    assert rd.verify(usable.path.parent / "step_000002") is None  # saved over, sealed
    again = LocalRun(config, run_dir=tmp_path)
    sink = MetricsSink(tmp_path, tensorboard=False)
    try:
        with caplog.at_level(logging.INFO, logger="moe_rl.driver"):
            assert again.job.restore(sink, usable) == 4
    finally:
        sink.close()
    assert f"resumed from {usable.path} at step 4 (policy version 4)" in caplog.messages
    assert again.stages.state.version == 4 and again.stages.state.step_done == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]  # the step after it dropped
    assert again.stages.source.state() == stream
    again.job.shutdown()
