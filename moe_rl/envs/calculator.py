"""The `calculator` environment: a tool the model calls with token-id arithmetic.

The model's turn either calls the tool, ``CALL <expression tokens> END_CALL`` (END_CALL is a stop
token, so the turn ends there), and the environment answers ``RESULT <value tokens> END_RESULT``
(or ``RESULT ERROR END_RESULT``) for the model to read on its next turn; or it is the final answer,
scored against the prompt's answer. The token layout is `moe_rl.rewards.tasks`' (digits 3..12,
operators and tool tokens 13..22), re-exported here; its task is `tool_multiply`.

Expressions are evaluated by a small tokenizer and recursive-descent parser, never by Python's
``eval``: non-negative integer literals, ``+ - *``, exact integer division ``/``, unary minus and
parentheses, with bounds on length, nesting and magnitude so no expression can be expensive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from moe_rl.envs.base import Environment, StepResult
from moe_rl.errors import EnvError
from moe_rl.rewards.tasks import (
    BOS,
    CALL,
    DIGIT0,
    END_CALL,
    END_RESULT,
    EOS,
    ERROR,
    LPAREN,
    MIN_TOOL_VOCAB,
    MINUS,
    NUM_DIGITS,
    PLUS,
    RESULT,
    RPAREN,
    TIMES,
    Prompt,
    answer_score,
)

__all__ = [
    "CALL",
    "END_CALL",
    "END_RESULT",
    "ERROR",
    "LPAREN",
    "MAX_DEPTH",
    "MAX_EXPR_LEN",
    "MAX_VALUE",
    "MINUS",
    "MIN_TOOL_VOCAB",
    "PLUS",
    "RESULT",
    "RPAREN",
    "TIMES",
    "CalculatorEnv",
    "CalculatorError",
    "evaluate",
    "int_to_tokens",
    "tokens_to_expr",
]

MAX_EXPR_LEN = 256
MAX_DEPTH = 32
MAX_VALUE = 10**18

OPERATOR_TOKENS = {PLUS: "+", MINUS: "-", TIMES: "*", LPAREN: "(", RPAREN: ")"}


class CalculatorError(ValueError):
    """An expression the calculator rejects; the message says what and at which character."""


# --- the evaluator ---------------------------------------------------------------------------


def evaluate(expr: str) -> int:
    """The integer value of ``expr``: literals, ``+ - * /`` (exact division only), unary minus and
    parentheses. Raises `CalculatorError` on anything else, on more than `MAX_EXPR_LEN` characters,
    nesting deeper than `MAX_DEPTH`, or a value (literal or intermediate) beyond ±`MAX_VALUE`."""
    if not isinstance(expr, str):
        raise CalculatorError(f"expected an expression string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_LEN:
        raise CalculatorError(f"expression is {len(expr)} characters long; at most {MAX_EXPR_LEN}")
    parser = _Parser(_tokenize(expr), len(expr))
    if parser.peek() is None:
        raise CalculatorError("empty expression")
    value = parser.expression(0)
    if parser.peek() is not None:
        raise parser.unexpected()
    return value


def _tokenize(expr: str) -> list[tuple[str, int]]:
    """``(token, position)`` pairs: whole literals, single-character operators; spaces skipped."""
    tokens, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in "0123456789":
            start = i
            while i < len(expr) and expr[i] in "0123456789":
                i += 1
            tokens.append((expr[start:i], start))
        elif c in "+-*/()":
            tokens.append((c, i))
            i += 1
        else:
            raise CalculatorError(f"invalid character {c!r} at {i}")
    return tokens


class _Parser:
    """expression := term (('+' | '-') term)*;  term := unary (('*' | '/') unary)*;
    unary := '-' unary | literal | '(' expression ')'. ``depth`` counts open parentheses and
    unary minus signs, which bounds the recursion."""

    def __init__(self, tokens: list[tuple[str, int]], end: int):
        self.tokens, self.end, self.i = tokens, end, 0

    def peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def position(self) -> int:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else self.end

    def unexpected(self) -> CalculatorError:
        token = self.peek()
        if token is None:
            return CalculatorError(f"unexpected end of expression at {self.end}")
        return CalculatorError(f"unexpected {token!r} at {self.position()}")

    def expression(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, at = self.peek(), self.position()
            self.i += 1
            right = self.term(depth)
            value = _bounded(value + right if op == "+" else value - right, at)
        return value

    def term(self, depth: int) -> int:
        value = self.unary(depth)
        while self.peek() in ("*", "/"):
            op, at = self.peek(), self.position()
            self.i += 1
            right = self.unary(depth)
            value = _bounded(value * right if op == "*" else _divide(value, right, at), at)
        return value

    def unary(self, depth: int) -> int:
        token, at = self.peek(), self.position()
        if token == "-" or token == "(":
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"nesting deeper than {MAX_DEPTH} at {at}")
            self.i += 1
            if token == "-":
                return -self.unary(depth + 1)
            value = self.expression(depth + 1)
            if self.peek() != ")":
                raise self.unexpected()
            self.i += 1
            return value
        if token is not None and token.isdigit():
            self.i += 1
            return _bounded(int(token), at)
        raise self.unexpected()


def _divide(a: int, b: int, at: int) -> int:
    if b == 0:
        raise CalculatorError(f"division by zero at {at}")
    if a % b:
        raise CalculatorError(f"inexact division {a} / {b} at {at}")
    return a // b


def _bounded(value: int, at: int) -> int:
    if abs(value) > MAX_VALUE:
        raise CalculatorError(f"value out of range at {at}: |value| > 10**18")
    return value


# --- tokens ----------------------------------------------------------------------------------


def tokens_to_expr(ids: Sequence[int]) -> str:
    """The expression text of digit, operator and parenthesis token ids; `CalculatorError` on any
    other token."""
    chars = []
    for i, t in enumerate(ids):
        if DIGIT0 <= t < DIGIT0 + NUM_DIGITS:
            chars.append(str(t - DIGIT0))
        elif t in OPERATOR_TOKENS:
            chars.append(OPERATOR_TOKENS[t])
        else:
            raise CalculatorError(f"token {t} at {i} is not a digit, operator or parenthesis")
    return "".join(chars)


def int_to_tokens(n: int) -> list[int]:
    """The digit tokens of ``n``, after a MINUS token when it is negative."""
    digits = [DIGIT0 + int(c) for c in str(abs(n))]
    return [MINUS, *digits] if n < 0 else digits


# --- the environment -------------------------------------------------------------------------


class CalculatorEnv(Environment):
    """A calculator tool over the `tool_multiply` token layout, one instance per trajectory.

    A turn that ends with END_CALL after a CALL is a tool call: the tokens between the last CALL
    and the END_CALL are evaluated (`evaluate`), the observation is ``RESULT <value> END_RESULT``,
    or ``RESULT ERROR END_RESULT`` when the tokens are not a valid expression (a tool error); the
    episode goes on, reward 0. Any other turn is the final answer: the episode ends with

        reward = answer score + call bonus, in [0, 1 + call_bonus]

    * answer score: the turn up to its first EOS against the prompt's answer, 1.0 when equal, else
      ``partial`` times the share of positions right over the longer of the two (`answer_score`);
    * call bonus: ``call_bonus`` times the best call score of the episode (given once, with the
      final answer; an episode cut off before answering gets no reward). A call scores 1.0 when it
      evaluated to the answer's value, else ``partial`` times the share of positions where it
      matches the prompt's own expression (the tokens between BOS and EOS, when they are one), so
      that a model learning to delegate is paid for each step towards the right call.

    With ``open_call`` the context starts with a tool call already opened (``reset`` appends CALL
    to the prompt), so the first turn is the body of a call: ending it with END_CALL calls the tool
    on what the turn wrote. A scaffold, as a chat template's tool-call preamble is one: a model that
    never saw the tool then calls it often enough, from the first steps, to learn what it returns.

    Kwargs (`env.kwargs`): ``partial`` in [0, 1] (default 0.5), ``call_bonus`` >= 0 (default 0),
    ``open_call`` (default false).
    Prompts need token-id answers (`data.task=synthetic:tool_multiply`) and `model.vocab_size` of
    at least `MIN_TOOL_VOCAB`.
    """

    stop_token_ids = (END_CALL,)

    def __init__(self, partial: float = 0.5, call_bonus: float = 0.0, open_call: bool = False):
        if not _is_real(partial) or not 0.0 <= partial <= 1.0:
            raise EnvError(f"calculator: partial={partial!r} must be a number in [0, 1]")
        if not _is_real(call_bonus) or call_bonus < 0.0:
            raise EnvError(f"calculator: call_bonus={call_bonus!r} must be a finite number >= 0")
        if not isinstance(open_call, bool):
            raise EnvError(f"calculator: open_call={open_call!r} must be true or false")
        self.partial, self.call_bonus, self.open_call = float(partial), float(call_bonus), open_call
        self.in_call = False
        self.answer: tuple[int, ...] = ()
        self.target: int | None = None

    def reset(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt.answer, str):
            raise EnvError(
                f"calculator: prompt answer {prompt.answer[:40]!r} is text; the calculator needs token-id "
                "answers, e.g. data.task=synthetic:tool_multiply"
            )
        self.answer = tuple(prompt.answer)
        try:
            self.target = evaluate(tokens_to_expr(self.answer))
        except CalculatorError:
            self.target = None  # an answer that is no number: no call can earn the bonus
        self.call_score = 0.0
        self.expression = _prompt_expression(prompt.ids)
        self.in_call = self.open_call
        return [*prompt.ids, CALL] if self.open_call else list(prompt.ids)

    def step(self, turn: list[int]) -> StepResult:
        opened, self.in_call = self.in_call, False
        if turn and turn[-1] == END_CALL and (opened or CALL in turn):
            start = len(turn) - 1 - turn[::-1].index(CALL) if CALL in turn else -1
            return self._call(turn[start + 1 : -1])
        reward = answer_score(self.answer, turn, self.partial) + self.call_bonus * self.call_score
        return StepResult([], reward=reward, done=True)

    def demonstrate(self, context: list[int]) -> list[int]:
        """The turn a model that uses the tool well writes next in ``context`` (demonstrations for a
        supervised warm start, `moe_rl.orchestration.sft`): first a call of the prompt's expression
        (its body alone when ``context`` ends with an opened CALL), then, once the tool has
        answered, its value as the answer. Reads only ``context``."""
        if RESULT in context:
            start = len(context) - 1 - context[::-1].index(RESULT)
            end = context.index(END_RESULT, start) if END_RESULT in context[start:] else len(context)
            return [*context[start + 1 : end], EOS]
        prompt = context[: context.index(EOS) + 1] if EOS in context else context
        expression = _prompt_expression(prompt)
        if expression is None:
            raise EnvError(
                f"calculator: the prompt {prompt[:16]} holds no expression to demonstrate a call of"
            )
        body = [*expression, END_CALL]
        return body if context and context[-1] == CALL else [CALL, *body]

    def _call(self, expression: list[int]) -> StepResult:
        if self.expression is not None:
            self.call_score = max(self.call_score, answer_score(self.expression, expression, self.partial))
        try:
            value = evaluate(tokens_to_expr(expression))
        except CalculatorError:
            return StepResult([RESULT, ERROR, END_RESULT], tool_calls=1, tool_errors=1)
        if value == self.target:
            self.call_score = 1.0
        return StepResult([RESULT, *int_to_tokens(value), END_RESULT], tool_calls=1)


def _prompt_expression(ids: Sequence[int]) -> tuple[int, ...] | None:
    """The expression a prompt asks about: its tokens between BOS and EOS, when they evaluate."""
    body = [t for t in ids if t not in (BOS, EOS)]
    try:
        evaluate(tokens_to_expr(body))
    except CalculatorError:
        return None
    return tuple(body)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
