"""`env.name` → a maker of environments: the built-in ones (`ENVIRONMENTS`) or a user class named
``package.module:Class`` (installed, on PYTHONPATH or in the working directory:
`moe_rl.rewards.functions.import_user_module`), checked when the maker is built (see
`build_env_factory`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_rl.envs.base import Environment, is_int
from moe_rl.envs.calculator import CalculatorEnv
from moe_rl.errors import EnvError
from moe_rl.rewards.functions import import_user_module
from moe_rl.rewards.tasks import Prompt

ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": CalculatorEnv}


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
        module = import_user_module(module_name)  # the working directory too
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
    if not isinstance(stop, list | tuple) or not all(is_int(t) and t >= 0 for t in stop):
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
