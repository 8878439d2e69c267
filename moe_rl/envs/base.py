"""The environment interface of multi-turn rollouts and its checks (`env.name` → a factory is
`moe_rl.envs.registry`).

An `Environment` is made once per trajectory (`moe_rl.envs.registry.build_env_factory` returns
the maker). The rollout
loop (`moe_rl.envs.rollout`) calls ``reset(prompt)`` for the first context, then after every model
turn ``step(turn)`` with the turn's token ids; the `StepResult` says what the environment writes
into the context, the reward to add, and whether the episode is over. A model turn ends at EOS, at
one of the environment's ``stop_token_ids`` (e.g. the end of a tool call) or at the turn's token
limit.

``reset`` and ``step`` may be plain methods or ``async def`` coroutines: the loop awaits a result
when it is awaitable (``inspect.isawaitable``), and runs the calls of all the trajectories of a
turn concurrently (one ``asyncio.gather``), so an environment that waits on a tool (a sandbox, a
web service) should be async. Every result is checked (`check_step_result`): a bad one is an
`EnvError` that names the environment, the field and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from moe_rl.errors import EnvError
from moe_rl.rewards.tasks import Prompt


@dataclass
class StepResult:
    """An environment's answer to one model turn."""

    observation: list[int] = field(default_factory=list)
    """Token ids the environment writes into the context (may be empty)."""
    reward: float = 0.0
    """Added to the trajectory's reward."""
    done: bool = False
    """The episode is over: no more model turns."""
    tool_calls: int = 0
    """Tool calls made in this step."""
    tool_errors: int = 0
    """Of them, how many failed (a bad expression, an unknown tool, ...)."""


class Environment:
    """Base class of multi-turn environments, one instance per trajectory (see the module
    docstring). Subclasses implement `step`, and `reset` when the first context is not the
    prompt's own ids; either may be ``async def``."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a model turn besides EOS (which the loop adds)."""

    def reset(self, prompt: Prompt) -> list[int] | Awaitable[list[int]]:
        """The context tokens the episode starts from; by default the prompt's ids."""
        return list(prompt.ids)

    def step(self, turn: list[int]) -> StepResult | Awaitable[StepResult]:
        """The model's last turn (its token ids, up to and including the stop token) → the
        environment's answer."""
        raise NotImplementedError(f"{type(self).__qualname__}.step")


def check_step_result(result: Any, vocab_size: int, where: str) -> None:
    """Raise `EnvError` (prefixed by ``where``, e.g. ``env calculator``) unless ``result`` is a
    `StepResult` with token ids in [0, vocab_size), a finite reward, a bool ``done`` and counts
    0 <= tool_errors <= tool_calls."""
    if not isinstance(result, StepResult):
        raise EnvError(
            f"{where}: step returned {type(result).__name__} {short_repr(result)}; expected a "
            "moe_rl.envs.StepResult"
        )
    obs = result.observation
    if not isinstance(obs, list | tuple):
        raise EnvError(
            f"{where}: StepResult.observation is a {type(obs).__name__}; expected a list of token ids"
        )
    for i, t in enumerate(obs):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise EnvError(
                f"{where}: StepResult.observation[{i}]={t!r} is not a token id in [0, {vocab_size}) "
                f"(model.vocab_size)"
            )
    reward = result.reward
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(reward):
        raise EnvError(f"{where}: StepResult.reward={reward!r} is not a finite number")
    if not isinstance(result.done, bool):
        raise EnvError(f"{where}: StepResult.done={result.done!r} is not a bool")
    for name in ("tool_calls", "tool_errors"):
        value = getattr(result, name)
        if not is_int(value) or value < 0:
            raise EnvError(f"{where}: StepResult.{name}={value!r} is not an integer >= 0")
    if result.tool_errors > result.tool_calls:
        raise EnvError(
            f"{where}: StepResult.tool_errors={result.tool_errors} > tool_calls={result.tool_calls}; "
            "errors count among the calls"
        )


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def short_repr(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
