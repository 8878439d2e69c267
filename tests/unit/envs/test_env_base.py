"""The environment interface: `check_step_result` and `build_env_factory` (built-in, user classes,
and every loader error)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from moe_rl.envs import (
    ENVIRONMENTS,
    CalculatorEnv,
    Environment,
    StepResult,
    build_env_factory,
    check_step_result,
)
from moe_rl.errors import EnvError, UserError
from moe_rl.rewards.tasks import BOS, EOS, Prompt

PROMPT = Prompt((BOS, 4, 5, EOS), (6,))
USER = "tests.unit.envs.user_envs"


# --- check_step_result ---


def test_valid_results_pass():
    for result in (
        StepResult([]),
        StepResult([0, 22], reward=-1, done=True, tool_calls=2, tool_errors=2),
        StepResult((1, 2), reward=0.5),
    ):
        check_step_result(result, 23, "env calculator")


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (None, "env x: step returned NoneType None; expected a moe_rl.envs.StepResult"),
        ({"observation": []}, "step returned dict"),
        (StepResult("abc"), "StepResult.observation is a str"),
        (StepResult([1, 23]), r"StepResult.observation\[1\]=23 is not a token id in \[0, 23\)"),
        (StepResult([-1]), r"StepResult.observation\[0\]=-1"),
        (StepResult([1.0]), r"StepResult.observation\[0\]=1.0"),
        (StepResult([True]), r"StepResult.observation\[0\]=True"),
        (StepResult([], reward=float("nan")), "StepResult.reward=nan is not a finite number"),
        (StepResult([], reward=float("inf")), "StepResult.reward=inf"),
        (StepResult([], reward="1"), "StepResult.reward='1'"),
        (StepResult([], reward=None), "StepResult.reward=None"),
        (StepResult([], done=1), "StepResult.done=1 is not a bool"),
        (StepResult([], tool_calls=-1), "StepResult.tool_calls=-1 is not an integer >= 0"),
        (StepResult([], tool_calls=1.0), "StepResult.tool_calls=1.0"),
        (StepResult([], tool_calls=1, tool_errors=2), "StepResult.tool_errors=2 > tool_calls=1"),
    ],
)
def test_bad_results(result, message):
    with pytest.raises(EnvError, match=message):
        check_step_result(result, 23, "env x")
    assert issubclass(EnvError, UserError)


# --- the interface ---


def test_default_reset_and_abstract_step():
    env = Environment()
    assert env.reset(PROMPT) == list(PROMPT.ids) and env.stop_token_ids == ()
    with pytest.raises(NotImplementedError):
        env.step([1])


def test_async_step_is_awaitable():
    make = build_env_factory(f"{USER}:AsyncEnv", {})
    env = make()
    assert not inspect.isawaitable(env.reset(PROMPT))
    pending = env.step([1])
    assert inspect.isawaitable(pending)
    assert asyncio.run(pending).reward == 1.0


# --- build_env_factory ---


def test_builtin_calculator():
    assert ENVIRONMENTS["calculator"] is CalculatorEnv and len(ENVIRONMENTS) == 1
    make = build_env_factory("calculator", {"call_bonus": 0.1})
    a, b = make(), make()
    assert isinstance(a, CalculatorEnv) and a is not b  # one environment per trajectory
    assert a.call_bonus == 0.1 and a.partial == 0.5


def test_user_subclass():
    make = build_env_factory(f"{USER}:EchoEnv", {"scale": 2.0})
    env = make()
    assert type(env).__name__ == "EchoEnv" and env.stop_token_ids == (7,)
    assert env.reset(PROMPT) == list(PROMPT.ids)
    assert env.step([3]) == StepResult([3], reward=2.0, done=False)
    assert make().turns == 0


def test_user_duck_typed_class_is_wrapped():
    env = build_env_factory(f"{USER}:DuckEnv", {})()
    assert isinstance(env, Environment) and env.stop_token_ids == ()
    assert env.reset(PROMPT) == [*PROMPT.ids, 5]
    assert env.step([1]) == StepResult([], reward=0.5, done=True)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "nope",
            {},
            "env.name='nope' is unknown; built-in environments: calculator, or `package.module:Class`",
        ),
        (":Cls", {}, "is unknown"),
        ("mod:", {}, "is unknown"),
        (
            "no_such_package.envs:Env",
            {},
            "env.name='no_such_package.envs:Env': cannot import no_such_package.envs",
        ),
        (f"{USER}:Missing", {}, f"{USER} has no class Missing"),
        (f"{USER}:EchoEnv.Missing", {}, "has no class EchoEnv.Missing"),
        (f"{USER}:make_env", {}, "make_env is a function, not a class"),
        (f"{USER}:NOT_A_CLASS", {}, "NOT_A_CLASS is a int, not a class"),
        (f"{USER}:NoStep", {}, "NoStep has no step method"),
        ("builtins:int", {}, "int has no reset / step method"),
        (f"{USER}:BadStopTokens", {}, r"stop_token_ids=\('end',\) is not a tuple of token ids"),
        (
            f"{USER}:EchoEnv",
            {"scal": 1},
            r"EchoEnv\(\*\*env.kwargs\) failed with env.kwargs=\{'scal': 1\}: TypeError",
        ),
        (f"{USER}:Strict", {}, r"user_envs.Strict\(\*\*env.kwargs\) failed with env.kwargs=\{\}: TypeError"),
        (f"{USER}:Strict", {"size": 0}, "ValueError: size=0 must be > 0"),
        ("calculator", {"partial": 2}, r"CalculatorEnv\(\*\*env.kwargs\) failed .*partial=2 must be"),
        ("calculator", {"bonus": 1}, "unexpected keyword argument 'bonus'"),
    ],
)
def test_loader_errors(name, kwargs, message):
    with pytest.raises(EnvError, match=message):
        build_env_factory(name, kwargs)
