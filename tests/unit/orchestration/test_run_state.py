"""The run's state between steps (`RunState`) as a checkpoint's ``driver.json`` stores it: read back
equal, the prompt stream resumed where the next step draws (in an async run, before the prompts
drawn ahead), and a ``driver.json`` written before the state counted flat steps still loads."""

from __future__ import annotations

import json
from pathlib import Path

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
