"""The turn loop's own checks and helpers, before any engine call: what `reset` may return, how
coroutines are awaited together, and the step's environment metrics."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_rl.envs.base import Environment, StepResult
from moe_rl.envs.rollout import MultiTurnRollout, TurnLimits, _run_all, env_metrics
from moe_rl.errors import EnvError
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec


class _Context(Environment):
    def __init__(self, context: list[int]):
        self.context = context

    def reset(self, prompt: Prompt) -> list[int]:
        return self.context

    def step(self, turn: list[int]) -> StepResult:
        return StepResult(done=True)


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ([], r"reset returned a context of 0 tokens \(trajectory 0\); expected 1 to data.max_prompt_len=8"),
        ([1] * 9, r"context of 9 tokens \(trajectory 0\); expected 1 to data.max_prompt_len=8"),
        ([1, 40], r"ids outside \[0, 32\) \(model.vocab_size\): \[1, 40\]"),
    ],
)
def test_reset_contexts_are_checked_before_any_generation(context, message):
    loop = MultiTurnRollout(None, lambda: _Context(context), TurnLimits(2, 16, 8), 32, "ctx")
    with pytest.raises(EnvError, match=message):  # the engine (None here) is never reached
        loop.generate([Prompt((1, 2), (3,))], SamplingSpec(max_new_tokens=4))


def test_coroutines_of_a_turn_run_together():
    spans: list[tuple[float, float]] = []

    async def slow(value: int) -> int:
        start = time.perf_counter()
        await asyncio.sleep(0.2)
        spans.append((start, time.perf_counter()))
        return value

    assert _run_all([slow(1), 2, slow(3), slow(4)]) == [1, 2, 3, 4]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # each began before any ended: together
    assert _run_all([5, 6]) == [5, 6]


def test_env_metrics_merge_replicas():
    one = {
        "trajectories": 4.0,
        "turns": 8.0,
        "tool_calls": 4.0,
        "tool_errors": 1.0,
        "done": 3.0,
        "truncated": 1.0,
        "env_seconds": 0.5,
    }
    two = {
        "trajectories": 4.0,
        "turns": 4.0,
        "tool_calls": 0.0,
        "tool_errors": 0.0,
        "done": 4.0,
        "truncated": 0.0,
        "env_seconds": 0.25,
    }
    out = env_metrics([one, two, {}])
    assert out == {
        "env/turns_per_trajectory": 1.5, "env/tool_calls_per_trajectory": 0.5, "env/tool_errors": 1.0,
        "env/tool_error_share": 0.25, "env/done_share": 0.875, "env/truncated_share": 0.125,
        "env/seconds": 0.75,
    }  # fmt: skip
    assert env_metrics([{}, {}]) == {}
