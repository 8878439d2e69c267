"""The run's state between steps (`RunState`) as a checkpoint's ``driver.json`` stores it: read back
equal, the prompt stream resumed where the next step draws (in an async run, before the prompts
drawn ahead), and a ``driver.json`` written before the state counted flat steps still loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_rl.orchestration.preflight import load_checked
from moe_rl.orchestration.run_state import RunState
from moe_rl.rewards.registry import build_prompt_source

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def _ids(prompts) -> list:
    return [p.ids for p in prompts]


def test_a_checkpoint_resumes_the_prompt_stream_before_the_prompts_drawn_ahead():
    config = load_checked(TINY)
    source = build_prompt_source(config)
    state = RunState(version=3, stale_rejected=16, flat_steps=2)
    for step in range(3):  # steps 0 .. 2 drawn (an async run two steps ahead)
        state.launched[step] = source.state()
        source.next_batch(8)
    state.end_step(0)
    assert sorted(state.launched) == [1, 2]  # step 0's is forgotten once it is done
    stored = json.loads(json.dumps(state.to_json(source.state())))
    resumed, source_state = RunState.from_json(stored)
    assert (resumed.step_done, resumed.version, resumed.stale_rejected, resumed.flat_steps) == (0, 3, 16, 2)
    again = build_prompt_source(config)
    again.load_state(source_state)
    replay = build_prompt_source(config)
    replay.next_batch(8)  # step 0's prompts
    assert _ids(again.next_batch(16)) == _ids(replay.next_batch(16))  # steps 1 and 2 drawn again


def test_without_prompts_drawn_ahead_the_stream_resumes_as_it_is_and_an_older_driver_json_loads():
    config = load_checked(TINY)
    source = build_prompt_source(config)
    source.next_batch(8)
    state = RunState()
    state.end_step(4)
    stored = state.to_json(source.state())
    del stored["flat_steps"]  # what a checkpoint written before the count was stored holds
    resumed, source_state = RunState.from_json(json.loads(json.dumps(stored)))
    assert resumed == RunState(step_done=4)
    again = build_prompt_source(config)
    again.load_state(source_state)
    assert _ids(again.next_batch(8)) == _ids(source.next_batch(8))


def test_a_new_run_starts_before_step_0_at_policy_version_0_with_nothing_counted():
    """A run without a checkpoint starts from these: its first checkpoint then stores step 0."""
    config = load_checked(TINY)
    source = build_prompt_source(config)
    fresh = RunState()
    assert (fresh.step_done, fresh.version, fresh.stale_rejected, fresh.flat_steps) == (-1, 0, 0, 0)
    stored = fresh.to_json(source.state())
    assert (stored["step"], stored["version"], stored["num_stale_rejected"], stored["flat_steps"]) == (
        -1,
        0,
        0,
        0,
    )


def _flat_stages(recipe: Path = TINY, *overrides: str):
    from moe_rl.config.run_plan import run_plan
    from moe_rl.orchestration.batches import ScoredSummary
    from moe_rl.orchestration.handles import Workers
    from moe_rl.orchestration.preflight import RunInputs
    from moe_rl.orchestration.stages import Rollout, Stages

    config = load_checked(recipe, list(overrides))
    workers = Workers(None, None, None, run_plan(config, "cpu"))
    stages = Stages(config, None, workers, RunInputs(build_prompt_source(config)))
    groups = torch.arange(4).repeat_interleave(2)

    def rollout(rewards: list[float]) -> Rollout:
        summary = ScoredSummary(8, torch.tensor(rewards), groups, plan=None, min_version=0)
        return Rollout([], summary)

    return stages, rollout


FLAT = [1.0] * 8
VARIED = [1.0, 0.0] + [1.0] * 6


def test_the_flat_reward_count_runs_over_flat_steps_in_a_row_and_warns_once_at_its_bound(caplog):
    """Every group's rewards equal: the count grows by one a step; one step with any varied group
    sets it back to 0. The warning comes at exactly `FLAT_REWARD_STEPS` in a row, not before and not
    again after (a checkpoint stores the count, so a resume goes on counting)."""
    from moe_rl.orchestration.stages import FLAT_REWARD_STEPS

    stages, rollout = _flat_stages()
    warned = []
    for step, rewards in enumerate([FLAT, FLAT, VARIED] + [FLAT] * (FLAT_REWARD_STEPS + 2)):
        caplog.clear()
        stages.advantages(rollout(rewards))
        warned += [(step, r.getMessage()) for r in caplog.records if "rewards have varied" in r.getMessage()]
        if step == 2:
            assert stages.state.flat_steps == 0
    assert [step for step, _ in warned] == [2 + FLAT_REWARD_STEPS]
    assert f"for {FLAT_REWARD_STEPS} steps in a row (reward/mean 1.000, min 1.000, max 1.000)" in warned[0][1]
    assert stages.state.flat_steps == FLAT_REWARD_STEPS + 2


def test_no_flat_reward_warning_for_an_offline_objective(caplog):
    """An offline objective's sample weights are never all 0: however flat the stored rewards, nothing
    counts and nothing warns."""
    from moe_rl.orchestration.stages import FLAT_REWARD_STEPS

    stages, rollout = _flat_stages(TINY.parent / "tiny_moe_dgo.yaml", "algo.objective=sft")
    for _ in range(FLAT_REWARD_STEPS + 1):
        stages.advantages(rollout(FLAT))
    assert stages.state.flat_steps == 0
    assert not [r for r in caplog.records if "rewards have varied" in r.getMessage()]
