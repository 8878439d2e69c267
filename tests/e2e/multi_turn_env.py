"""A scripted environment for the multi-turn tests: it answers every first turn with the same
observation and ends the episode at the second, so every trajectory has environment tokens
whatever an untrained model writes. Reward: the share of digit tokens in the final turn."""

from __future__ import annotations

from moe_rl.envs.base import Environment, StepResult
from moe_rl.envs.calculator import END_RESULT, RESULT
from moe_rl.rewards.tasks import DIGIT0, NUM_DIGITS


class ScriptedEnv(Environment):
    def __init__(self, observation: tuple[int, ...] = (RESULT, 4, 5, END_RESULT)):
        self.observation = list(observation)
        self.turns = 0

    def step(self, turn: list[int]) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(self.observation, tool_calls=1)
        digits = sum(DIGIT0 <= t < DIGIT0 + NUM_DIGITS for t in turn)
        return StepResult([], reward=digits / max(len(turn), 1), done=True)


ANSWER = [10 + i % 10 for i in range(20)]
"""A 20-token observation (digit tokens of the tool vocabulary): longer than what is left of
`LONG_ANSWER`'s ``env.max_tokens`` after the model's first turn."""
LONG_ANSWER = [
    "model.vocab_size=32", "data.task=synthetic:tool_multiply", "env.name=tests.e2e.multi_turn_env:ScriptedEnv",
    f"env.kwargs={{observation: {ANSWER}}}", "env.max_turns=3", "env.max_tokens=16",
]  # fmt: skip
"""The tiny recipe with `ScriptedEnv` answering `ANSWER`, which does not fit ``env.max_tokens=16``."""
