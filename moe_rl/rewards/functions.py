"""Reward functions on decoded text: math answers (math-verify), exact match, user functions."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

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


def load_user_function(spec: str) -> TextReward:
    """`package.module:function` → the function (called as `fn(response_text, answer_text)`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(
            f"data.reward={spec!r}: a user reward is given as `package.module:function`"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardFunctionError(f"data.reward={spec!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"data.reward={spec!r}: {module_name} has no function {attr}")
    return fn
