"""Synthetic verifiable tasks, generated locally from a seed (no downloads).

Token layout shared by every synthetic task: 0 = PAD, 1 = BOS, 2 = EOS, 3..12 = the digits 0..9,
the rest of the vocabulary is filler the model must learn not to emit. Each task makes prompts
with an answer, and scores a response in [0, 1].

Tool-using tasks (`tool_multiply`, with the `calculator` environment of `moe_rl.envs.calculator`)
extend the layout: 13..17 = the operators `+ - *` and the parentheses `( )`, 18 = CALL (opens a
tool call), 19 = END_CALL (closes it and ends the model's turn), 20 / 21 = RESULT / END_RESULT
around the tool's answer, 22 = ERROR (the call failed). A task's `min_vocab` is the smallest
`model.vocab_size` it fits in (`check_task_vocab`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from moe_rl.errors import UserError

PAD, BOS, EOS = 0, 1, 2
DIGIT0 = 3
NUM_DIGITS = 10
MIN_VOCAB = DIGIT0 + NUM_DIGITS
PLUS, MINUS, TIMES, LPAREN, RPAREN = 13, 14, 15, 16, 17
CALL, END_CALL, RESULT, END_RESULT, ERROR = 18, 19, 20, 21, 22
MIN_TOOL_VOCAB = ERROR + 1


def digit_token(d: int) -> int:
    return DIGIT0 + d


def until_eos(response: Sequence[int]) -> list[int]:
    """The response up to (not including) its first EOS."""
    body = list(response)
    return body[: body.index(EOS)] if EOS in body else body


def answer_score(answer: Sequence[int], response: Sequence[int], partial: float) -> float:
    """1.0 when the response (up to its first EOS) is the answer; else ``partial`` times the share
    of positions right, over the longer of the two (so extra tokens cost too)."""
    body, answer = until_eos(response), list(answer)
    if body == answer:
        return 1.0
    right = sum(r == a for r, a in zip(body, answer))
    return partial * right / max(len(body), len(answer), 1)


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids, its reference answer (token ids or text), and where it came from."""

    ids: tuple[int, ...]
    answer: tuple[int, ...] | str
    source: str = ""


class SyntheticTask:
    """Base class: `make(n, rng)` prompts and `score(prompt, response_ids)` in [0, 1]."""

    name = ""
    min_vocab = MIN_VOCAB

    def make(self, n: int, rng: random.Random) -> list[Prompt]:
        return [self.make_one(rng) for _ in range(n)]

    def make_one(self, rng: random.Random) -> Prompt:
        raise NotImplementedError

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        raise NotImplementedError


class RepeatDigit(SyntheticTask):
    """Prompt `BOS d1 d2 d3 EOS`: answer by repeating the last digit d3 until the end.

    Reward: the share of response tokens (up to the first EOS, which may end it) equal to d3. An
    untrained model over a vocabulary V scores about 1/V; learning needs attention to the prompt.
    """

    name = "repeat_digit"

    def make_one(self, rng: random.Random) -> Prompt:
        digits = [rng.randrange(NUM_DIGITS) for _ in range(3)]
        ids = (BOS, *(digit_token(d) for d in digits), EOS)
        return Prompt(ids, (digit_token(digits[-1]),), self.name)

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        body = until_eos(response)
        if not body:
            return 0.0
        target = prompt.answer[0]
        return sum(t == target for t in body) / len(body)


class AddMod10(SyntheticTask):
    """Prompt `BOS a b EOS`: answer (a + b) mod 10 as the first response token (exact match)."""

    name = "add_mod10"

    def make_one(self, rng: random.Random) -> Prompt:
        a, b = rng.randrange(NUM_DIGITS), rng.randrange(NUM_DIGITS)
        return Prompt((BOS, digit_token(a), digit_token(b), EOS), (digit_token((a + b) % 10),), self.name)

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        return float(len(response) > 0 and response[0] == prompt.answer[0])


class CopySequence(SyntheticTask):
    """Prompt `BOS d1..d4 EOS`: copy the four digits. Reward: the share of positions right."""

    name = "copy_sequence"

    def make_one(self, rng: random.Random) -> Prompt:
        digits = tuple(digit_token(rng.randrange(NUM_DIGITS)) for _ in range(4))
        return Prompt((BOS, *digits, EOS), digits, self.name)

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        answer = prompt.answer
        return sum(r == a for r, a in zip(response, answer)) / len(answer)


class CountUp(SyntheticTask):
    """Prompt `BOS d1 d2 d3` counting up mod 10 (d2 = d1 + 1, ...): keep counting.

    Reward: the share of response tokens (up to the first EOS) that are the previous token's digit
    plus one, mod 10. Each token depends only on the one before it, so even a tiny model learns
    the rule from a few thousand samples; an untrained model over a vocabulary V scores about 1/V.
    """

    name = "count_up"

    def make_one(self, rng: random.Random) -> Prompt:
        start = rng.randrange(NUM_DIGITS)
        digits = [(start + i) % NUM_DIGITS for i in range(3)]
        return Prompt(
            (BOS, *(digit_token(d) for d in digits)), (digit_token((digits[-1] + 1) % 10),), self.name
        )

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        body = until_eos(response)
        if not body:
            return 0.0
        previous = [prompt.ids[-1], *body[:-1]]
        right = sum(
            DIGIT0 <= p < DIGIT0 + NUM_DIGITS and t == digit_token((p - DIGIT0 + 1) % NUM_DIGITS)
            for p, t in zip(previous, body)
        )
        return right / len(body)


class ToolMultiply(SyntheticTask):
    """Prompt `BOS a1 a2 TIMES b1 b2 EOS` with a, b in 10..99: answer the digits of a * b.

    Made for the `calculator` environment (`env.name=calculator`): the model may call the tool,
    `CALL a1 a2 TIMES b1 b2 END_CALL`, read `RESULT digits END_RESULT` and copy them. Alone (one
    turn, `data.reward=synthetic`) the model must multiply on its own; the score is the one the
    environment gives a final answer with ``partial=0.5``: 1.0 for the exact digits (up to the first
    EOS), else half the share of positions right.
    """

    name = "tool_multiply"
    min_vocab = MIN_TOOL_VOCAB

    def make_one(self, rng: random.Random) -> Prompt:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        ids = (BOS, *_digit_tokens(a), TIMES, *_digit_tokens(b), EOS)
        return Prompt(ids, tuple(_digit_tokens(a * b)), self.name)

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        return answer_score(prompt.answer, response, partial=0.5)


def _digit_tokens(n: int) -> list[int]:
    return [digit_token(int(c)) for c in str(n)]


TASKS: dict[str, type[SyntheticTask]] = {
    t.name: t for t in (RepeatDigit, CountUp, AddMod10, CopySequence, ToolMultiply)
}


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise UserError(f"data.task=synthetic:{name} is unknown; synthetic tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


def check_task_vocab(name: str, vocab_size: int) -> None:
    """A clear error when `data.task=synthetic:<name>` needs more token ids than the model has."""
    need = get_task(name).min_vocab
    if vocab_size < need:
        raise UserError(
            f"model.vocab_size={vocab_size} is too small for data.task=synthetic:{name}: its token "
            f"layout needs at least {need} ids"
        )
