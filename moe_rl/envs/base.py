"""The environment interface of multi-turn rollouts, its checks, and `env.name` → a factory.

An `Environment` is made once per trajectory (`build_env_factory` returns the maker). The rollout
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

import importlib
import math
import numbers
from collections.abc import Awaitable, Callable
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
            f"{where}: step returned {type(result).__name__} {_short(result)}; expected a "
            "moe_rl.envs.StepResult"
        )
    obs = result.observation
    if not isinstance(obs, list | tuple):
        raise EnvError(
            f"{where}: StepResult.observation is a {type(obs).__name__}; expected a list of token ids"
        )
    for i, t in enumerate(obs):
        if not _is_int(t) or not 0 <= t < vocab_size:
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
        if not _is_int(value) or value < 0:
            raise EnvError(f"{where}: StepResult.{name}={value!r} is not an integer >= 0")
    if result.tool_errors > result.tool_calls:
        raise EnvError(
            f"{where}: StepResult.tool_errors={result.tool_errors} > tool_calls={result.tool_calls}; "
            "errors count among the calls"
        )


def build_env_factory(name: str, kwargs: dict[str, Any]) -> Callable[[], Environment]:
    """`env.name` and `env.kwargs` → a maker of one environment per trajectory.

    ``name`` is a built-in (`ENVIRONMENTS`) or ``package.module:Class`` (a subclass of
    `Environment`, or any class with ``reset`` and ``step`` methods; it is wrapped in one). One
    instance is made here, so a class that cannot be loaded or rejects the kwargs fails now, with
    its name and the kwargs.
    """
    kwargs = dict(kwargs)
    cls = ENVIRONMENTS.get(name) or _load_class(name)
    label = f"{cls.__module__}.{cls.__qualname__}"
    probe = _construct(cls, kwargs, name, label)
    stop = _stop_tokens(probe, name)
    if isinstance(probe, Environment):
        return lambda: cls(**kwargs)
    return lambda: _Wrapped(cls(**kwargs), stop)


def _load_class(spec: str) -> type:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(
            f"env.name={spec!r} is unknown; built-in environments: {', '.join(sorted(ENVIRONMENTS))}, "
            "or `package.module:Class` for your own"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"env.name={spec!r}: cannot import {module_name}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise EnvError(f"env.name={spec!r}: {module_name} has no class {attr}")
    if not isinstance(obj, type):
        raise EnvError(
            f"env.name={spec!r}: {module_name}.{attr} is a {type(obj).__name__}, not a class; expected a "
            "subclass of moe_rl.envs.Environment"
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise EnvError(
            f"env.name={spec!r}: {module_name}.{attr} has no {' / '.join(missing)} method; expected a "
            "subclass of moe_rl.envs.Environment"
        )
    return obj


def _construct(cls: type, kwargs: dict[str, Any], name: str, label: str) -> Any:
    try:
        return cls(**kwargs)
    except Exception as exc:  # the user's constructor: any failure is reported with what it was given
        raise EnvError(
            f"env.name={name}: {label}(**env.kwargs) failed with env.kwargs={kwargs!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _stop_tokens(env: Any, name: str) -> tuple[int, ...]:
    stop = getattr(env, "stop_token_ids", ())
    if not isinstance(stop, list | tuple) or not all(_is_int(t) and t >= 0 for t in stop):
        raise EnvError(
            f"env.name={name}: stop_token_ids={stop!r} is not a tuple of token ids (integers >= 0)"
        )
    return tuple(int(t) for t in stop)


class _Wrapped(Environment):
    """A user environment that does not subclass `Environment`, behind its interface."""

    def __init__(self, inner: Any, stop_token_ids: tuple[int, ...]):
        self.inner, self.stop_token_ids = inner, stop_token_ids

    def reset(self, prompt: Prompt) -> Any:
        return self.inner.reset(prompt)

    def step(self, turn: list[int]) -> Any:
        return self.inner.step(turn)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# The built-in environments import this module's interface, so they are registered after it.
from moe_rl.envs.calculator import CalculatorEnv  # noqa: E402

ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": CalculatorEnv}
