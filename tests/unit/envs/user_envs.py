"""Environments for the loader tests, named as `tests.unit.envs.user_envs:<Class>`."""

from __future__ import annotations

from moe_rl.envs.base import Environment, StepResult
from moe_rl.rewards.tasks import Prompt

NOT_A_CLASS = 3


def make_env() -> None:
    """A function, not a class."""


class EchoEnv(Environment):
    """Writes the turn back once, then ends with reward ``scale``."""

    stop_token_ids = (7,)

    def __init__(self, scale: float = 1.0):
        self.scale, self.turns = scale, 0

    def step(self, turn: list[int]) -> StepResult:
        self.turns += 1
        return StepResult(list(turn), reward=self.scale, done=self.turns > 1)


class DuckEnv:
    """Not an `Environment` subclass: only `reset` and `step`."""

    def reset(self, prompt: Prompt) -> list[int]:
        return [*prompt.ids, 5]

    def step(self, turn: list[int]) -> StepResult:
        return StepResult([], reward=0.5, done=True)


class AsyncEnv(Environment):
    async def step(self, turn: list[int]) -> StepResult:
        return StepResult([], reward=1.0, done=True)


class NoStep:
    def reset(self, prompt: Prompt) -> list[int]:
        return list(prompt.ids)


class BadStopTokens(Environment):
    stop_token_ids = ("end",)

    def step(self, turn: list[int]) -> StepResult:
        return StepResult([])


class Strict(Environment):
    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"size={size} must be > 0")
        self.size = size

    def step(self, turn: list[int]) -> StepResult:
        return StepResult([])
