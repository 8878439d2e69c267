"""The calculator's evaluator, its token layout, `CalculatorEnv` episodes and `tool_multiply`."""

from __future__ import annotations

import random

import pytest

from moe_rl.envs.calculator import (
    CALL,
    END_CALL,
    END_RESULT,
    ERROR,
    LPAREN,
    MAX_DEPTH,
    MIN_TOOL_VOCAB,
    MINUS,
    PLUS,
    RESULT,
    RPAREN,
    TIMES,
    CalculatorEnv,
    CalculatorError,
    evaluate,
    int_to_tokens,
    tokens_to_expr,
)
from moe_rl.errors import EnvError, UserError
from moe_rl.rewards import get_task
from moe_rl.rewards.tasks import (
    BOS,
    EOS,
    MIN_VOCAB,
    TASKS,
    Prompt,
    ToolMultiply,
    check_task_vocab,
    digit_token,
)


def digits(n: int) -> list[int]:
    return [digit_token(int(c)) for c in str(n)]


# --- evaluate ---


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("42", 42),
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("2-3-4", -5),
        ("2*3-4*5", -14),
        ("-3", -3),
        ("--3", 3),
        ("-3*-2", 6),
        ("-(2+3)*4", -20),
        ("12/4/3", 1),
        ("-12/4", -3),
        ("100/(2*5)", 10),
        (" 1 +\t2 ", 3),
        ("007", 7),
        ("1000000000*1000000000", 10**18),
        ("((((1))))", 1),
    ],
)
def test_evaluate(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("7/2", "inexact division 7 / 2 at 1"),
        ("1/0", "division by zero at 1"),
        ("1/(2-2)", "division by zero at 1"),
        ("(1+2", "unexpected end of expression at 4"),
        ("1+", "unexpected end of expression at 2"),
        ("1+2)", r"unexpected '\)' at 3"),
        (")", r"unexpected '\)' at 0"),
        ("()", r"unexpected '\)' at 1"),
        ("1 2", "unexpected '2' at 2"),
        ("*3", r"unexpected '\*' at 0"),
        ("+3", r"unexpected '\+' at 0"),
        ("2**3", r"unexpected '\*' at 2"),
        ("2^3", "invalid character '\\^' at 1"),
        ("1.5", "invalid character '.' at 1"),
        ("x+1", "invalid character 'x' at 0"),
        ("__import__('os')", "invalid character '_' at 0"),
        ("(lambda: 1)()", "invalid character 'l' at 1"),
        ("1_000", "invalid character '_' at 1"),
        ("٣", "invalid character"),  # a non-ASCII digit
        ("1000000000000000001", "out of range at 0"),
        ("1000000000*1000000000+1", "out of range at 21"),
        ("1000000000*1000000000*10", "out of range at 21"),
        ("-1000000000*1000000000-1", "out of range at 22"),
        ("1" * 257, "257 characters long; at most 256"),
        (
            "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1),
            f"nesting deeper than {MAX_DEPTH} at {MAX_DEPTH}",
        ),
        ("-" * (MAX_DEPTH + 1) + "1", f"nesting deeper than {MAX_DEPTH}"),
    ],
)
def test_evaluate_errors(expr, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expr)


def test_evaluate_limits_are_inclusive():
    assert evaluate("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    assert evaluate("1" * 18) == int("1" * 18)
    assert evaluate("+".join(["1"] * 128)[:255]) == 128  # long flat chains are iterative
    assert issubclass(CalculatorError, ValueError)


def test_evaluate_never_runs_python(monkeypatch):
    import builtins

    def forbidden(*args, **kwargs):
        raise AssertionError("the evaluator must not run Python code")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert evaluate("(2+3)*4") == 20
    for expr in ("__import__('os').system('true')", "open('x')", "[1]", "1 if 1 else 2", "0x10", "1e3"):
        with pytest.raises(CalculatorError):
            evaluate(expr)


# --- tokens ---


def test_token_layout():
    assert (PLUS, MINUS, TIMES, LPAREN, RPAREN) == (13, 14, 15, 16, 17)
    assert (CALL, END_CALL, RESULT, END_RESULT, ERROR) == (18, 19, 20, 21, 22)
    assert MIN_TOOL_VOCAB == 23 and MIN_VOCAB == 13


def test_tokens_to_expr_and_back():
    ids = [LPAREN, *digits(12), PLUS, *digits(3), RPAREN, TIMES, MINUS, *digits(4)]
    assert tokens_to_expr(ids) == "(12+3)*-4"
    assert evaluate(tokens_to_expr(ids)) == -60
    assert tokens_to_expr([]) == ""
    assert int_to_tokens(0) == digits(0)
    assert int_to_tokens(1008) == digits(1008)
    assert int_to_tokens(-45) == [MINUS, *digits(45)]
    for n in (0, 7, -7, 123456, -(10**18)):
        assert evaluate(tokens_to_expr(int_to_tokens(n))) == n


@pytest.mark.parametrize("bad", [EOS, BOS, CALL, END_CALL, ERROR, 99])
def test_tokens_to_expr_rejects_other_tokens(bad):
    with pytest.raises(CalculatorError, match=f"token {bad} at 1 is not a digit"):
        tokens_to_expr([digit_token(1), bad])


# --- the environment ---


def multiply_prompt(a: int = 12, b: int = 34) -> Prompt:
    return Prompt((BOS, *digits(a), TIMES, *digits(b), EOS), tuple(digits(a * b)), "tool_multiply")


def call(*ids: int) -> list[int]:
    return [CALL, *ids, END_CALL]


def test_episode_call_then_right_answer():
    env, prompt = CalculatorEnv(), multiply_prompt()
    assert env.stop_token_ids == (END_CALL,)
    assert env.reset(prompt) == list(prompt.ids)
    first = env.step(call(*digits(12), TIMES, *digits(34)))
    assert first.observation == [RESULT, *digits(408), END_RESULT]
    assert (first.reward, first.done, first.tool_calls, first.tool_errors) == (0.0, False, 1, 0)
    final = env.step([*digits(408), EOS])
    assert (final.observation, final.reward, final.done, final.tool_calls) == ([], 1.0, True, 0)


def test_call_bonus_once_for_the_best_call_of_the_episode():
    env = CalculatorEnv(call_bonus=0.25)
    env.reset(multiply_prompt())
    env.step(call(*digits(34), TIMES, *digits(12)))  # any expression of the right value
    env.step(call(*digits(408)))
    assert env.step([*digits(408), EOS]).reward == 1.25
    env.reset(multiply_prompt())  # a new episode forgets the old calls
    env.step(call(*digits(12), PLUS, *digits(34)))  # 4 of the prompt's 5 expression tokens in place
    assert env.step([*digits(408), EOS]).reward == pytest.approx(1.0 + 0.25 * 0.5 * 4 / 5)
    env.reset(multiply_prompt())
    env.step(call(*digits(99)))  # a valid call with nothing of the prompt's expression
    assert env.step([*digits(408), EOS]).reward == 1.0
    env.reset(multiply_prompt())
    env.step(call(PLUS, PLUS))  # a tool error still earns what it matched: nothing here
    assert env.step([*digits(408), EOS]).reward == 1.0
    env.reset(multiply_prompt())
    env.step(call(*digits(408)))
    assert env.step([*digits(400), EOS]).reward == pytest.approx(0.5 * 2 / 3 + 0.25)


def test_tool_error_observation():
    env = CalculatorEnv()
    env.reset(multiply_prompt())
    for turn in (call(*digits(7), TIMES), call(*digits(7), EOS), call(), call(*digits(7), 99)):
        r = env.step(turn)
        assert r.observation == [RESULT, ERROR, END_RESULT]
        assert (r.reward, r.done, r.tool_calls, r.tool_errors) == (0.0, False, 1, 1)


def test_last_call_of_the_turn_is_evaluated():
    env = CalculatorEnv()
    env.reset(multiply_prompt())
    r = env.step([*digits(5), CALL, *digits(9), CALL, *digits(2), PLUS, *digits(3), END_CALL])
    assert r.observation == [RESULT, *digits(5), END_RESULT]
    r = env.step([CALL, *digits(2), TIMES, MINUS, *digits(3), END_CALL])
    assert r.observation == [RESULT, MINUS, *digits(6), END_RESULT]


@pytest.mark.parametrize(
    ("turn", "reward"),
    [
        ([*digits(408), EOS], 1.0),
        (digits(408), 1.0),  # no EOS (the turn hit its token limit): all of it is the answer
        ([*digits(408), EOS, 5, 5], 1.0),  # what follows EOS does not count
        ([*digits(407), EOS], 0.5 * 2 / 3),
        ([*digits(4080), EOS], 0.5 * 3 / 4),  # extra tokens cost
        ([*digits(40), EOS], 0.5 * 2 / 3),
        ([EOS], 0.0),
        ([], 0.0),
        ([CALL, *digits(408)], 0.0),  # a call cut off before END_CALL is an answer
        ([*digits(408), END_CALL], 0.5 * 3 / 4),  # END_CALL without CALL is an answer too
    ],
)
def test_final_answer_score(turn, reward):
    env = CalculatorEnv()
    env.reset(multiply_prompt())
    result = env.step(turn)
    assert result.done and result.tool_calls == 0
    assert result.reward == pytest.approx(reward)


def test_partial_kwarg():
    env = CalculatorEnv(partial=0.0)
    env.reset(multiply_prompt())
    assert env.step([*digits(407), EOS]).reward == 0.0
    env = CalculatorEnv(partial=1.0)
    env.reset(multiply_prompt())
    assert env.step([*digits(407), EOS]).reward == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partial": 1.5}, "partial=1.5 must be a number in"),
        ({"partial": -0.1}, "partial=-0.1"),
        ({"partial": "half"}, "partial='half'"),
        ({"call_bonus": -1}, "call_bonus=-1 must be a finite number >= 0"),
        ({"call_bonus": float("nan")}, "call_bonus=nan"),
        ({"call_bonus": True}, "call_bonus=True"),
    ],
)
def test_bad_kwargs(kwargs, message):
    with pytest.raises(EnvError, match=message):
        CalculatorEnv(**kwargs)


def test_text_answers_are_rejected():
    with pytest.raises(EnvError, match="token-id answers"):
        CalculatorEnv().reset(Prompt((BOS, EOS), "408"))


# --- tool_multiply ---


def test_tool_multiply_prompts():
    task = get_task("tool_multiply")
    assert isinstance(task, ToolMultiply) and TASKS["tool_multiply"] is ToolMultiply
    assert task.min_vocab == MIN_TOOL_VOCAB and get_task("count_up").min_vocab == MIN_VOCAB
    for p in task.make(200, random.Random(0)):
        assert len(p.ids) == 7 and p.ids[0] == BOS and p.ids[3] == TIMES and p.ids[-1] == EOS
        a, b = int(tokens_to_expr(p.ids[1:3])), int(tokens_to_expr(p.ids[4:6]))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert list(p.answer) == digits(a * b) and p.answer[0] != digit_token(0)
        assert p.source == "tool_multiply"
    assert task.make(5, random.Random(1)) == task.make(5, random.Random(1))


def test_tool_multiply_score_matches_the_environment():
    task, prompt = get_task("tool_multiply"), multiply_prompt(25, 40)  # 1000
    for turn in ([*digits(1000), EOS], [*digits(1001)], [*digits(10), EOS, 3], [EOS], [*digits(100000)]):
        env = CalculatorEnv()
        env.reset(prompt)
        assert task.score(prompt, turn) == pytest.approx(env.step(turn).reward)
    assert task.score(prompt, digits(1000)) == 1.0
    assert task.score(prompt, [*digits(1001), EOS]) == pytest.approx(0.5 * 3 / 4)


def test_check_task_vocab():
    check_task_vocab("tool_multiply", MIN_TOOL_VOCAB)
    check_task_vocab("count_up", MIN_VOCAB)
    with pytest.raises(
        UserError, match=r"model.vocab_size=20 is too small for data.task=synthetic:tool_multiply"
    ):
        check_task_vocab("tool_multiply", 20)
