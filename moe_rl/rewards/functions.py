"""Reward functions on decoded text: math answers (math-verify), exact match, user functions."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from moe_rl.errors import RewardFunctionError

TextReward = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding white space, equals the answer."""
    return float(response.strip() == answer.strip())


def math_answer(response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference.

    ``response`` is the decoded response text (special tokens dropped); math-verify extracts its
    final answer (a ``\\boxed{}`` one first, then LaTeX or plain expressions: ``17+25=42`` gives
    42) and compares it with the reference symbolically. Its time limits use ``signal.alarm``,
    which only the main thread may set: off the main thread (a threaded actor) it parses without
    them.
    """
    from math_verify import parse, verify

    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=seconds)
    if not gold:
        raise ValueError(f"math reward: the reference answer {answer!r} does not parse as math")
    predicted = parse(response, parsing_timeout=seconds)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=seconds))


def import_user_module(name: str) -> ModuleType:
    """The module of a user's `module:function` or `module:Class`, from the installed packages and
    PYTHONPATH, else from the working directory (a ``name.py`` or ``name/`` there, which `python -m`
    finds and the `moe-rl` command alone does not): the folder is then added to the end of
    ``sys.path``. Ray adds the driver's working directory to its workers' path, so the reward
    worker imports it too. Not found anywhere, the error says where it looked and what to do."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top, here = name.partition(".")[0], os.getcwd()
        if exc.name != top:  # found, but it (or what it imports) is not
            raise
        if here in sys.path or not ((Path(here) / f"{top}.py").is_file() or (Path(here) / top).is_dir()):
            raise ModuleNotFoundError(
                f"no module named {top!r} in the installed packages, PYTHONPATH or the working directory "
                f"{here}; put {top}.py in the folder you run moe-rl from, or add its folder to PYTHONPATH",
                name=top,
            ) from None
    sys.path.append(here)
    return importlib.import_module(name)


def load_user_function(spec: str) -> TextReward:
    """`package.module:function` → the function (called as `fn(response_text, answer_text)`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(
            f"data.reward={spec!r}: a user reward is given as `package.module:function`"
        )
    try:
        module = import_user_module(module_name)
    except ImportError as exc:
        raise RewardFunctionError(f"data.reward={spec!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"data.reward={spec!r}: {module_name} has no function {attr}")
    return fn
