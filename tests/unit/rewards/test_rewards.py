"""Rewards and prompt sources."""

from __future__ import annotations

import json
import random

import pytest

from moe_rl.rewards import ByteTokenizer, PromptSource, RewardScorer, get_task
from moe_rl.rewards.functions import exact_match, load_user_function, math_answer
from moe_rl.rewards.tasks import BOS, EOS, digit_token


def test_repeat_digit_scores_share_of_right_tokens():
    task = get_task("repeat_digit")
    prompt = task.make_one(random.Random(0))
    target = prompt.answer[0]
    assert prompt.ids[0] == BOS and prompt.ids[-1] == EOS and prompt.ids[-2] == target
    assert task.score(prompt, [target] * 4) == 1.0
    assert task.score(prompt, [target, target, 50, 50]) == 0.5
    assert task.score(prompt, [target, EOS, 50]) == 1.0  # EOS ends the response
    assert task.score(prompt, [EOS]) == 0.0


def test_add_mod10_and_copy():
    add = get_task("add_mod10")
    p = add.make_one(random.Random(3))
    a, b = p.ids[1] - digit_token(0), p.ids[2] - digit_token(0)
    assert add.score(p, [digit_token((a + b) % 10)]) == 1.0
    assert add.score(p, [digit_token((a + b + 1) % 10)]) == 0.0
    copy = get_task("copy_sequence")
    p = copy.make_one(random.Random(1))
    assert copy.score(p, list(p.answer)) == 1.0
    assert copy.score(p, [*p.answer[:2], 0, 0]) == 0.5


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="repeat_digit"):
        get_task("nope")


def test_prompt_source_is_seeded_and_resumable():
    a, b = PromptSource("synthetic:repeat_digit", seed=7), PromptSource("synthetic:repeat_digit", seed=7)
    assert a.next_batch(5) == b.next_batch(5)
    state = a.state()
    first = a.next_batch(3)
    b.load_state(state)
    assert b.next_batch(3) == first


def test_math_and_exact_match():
    assert math_answer("so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math_answer("the answer is 3", "4") == 0.0
    assert exact_match(" yes \n", "yes") == 1.0 and exact_match("no", "yes") == 0.0


def test_file_source_and_text_reward(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) for i in range(4)))
    tok = ByteTokenizer()
    src = PromptSource(f"file:{path}", seed=0, tokenizer=tok, prompt_key="q", answer_key="a")
    prompts = src.next_batch(4)
    assert sorted(p.answer for p in prompts) == ["0", "2", "4", "6"]
    scorer = RewardScorer("exact_match", tokenizer=tok)
    p = prompts[0]
    assert scorer.score(p, [*tok.encode(p.answer)[1:], EOS, 99]) == 1.0
    with pytest.raises(ValueError, match="column 'question'"):
        PromptSource(f"file:{path}", seed=0, tokenizer=tok, prompt_key="question")


def test_user_function_spec_errors():
    assert load_user_function("moe_rl.rewards.functions:exact_match") is exact_match
    with pytest.raises(ValueError, match="package.module:function"):
        load_user_function("nocolon")
    with pytest.raises(ValueError, match="has no function"):
        load_user_function("moe_rl.rewards.functions:nothing")


def test_count_up_scores_successors_of_the_previous_token():
    task = get_task("count_up")
    prompt = task.make_one(random.Random(4))
    last = prompt.ids[-1] - digit_token(0)
    right = [digit_token((last + i) % 10) for i in range(1, 5)]
    assert task.score(prompt, right) == 1.0
    assert task.score(prompt, [right[0], right[0], right[0]]) == pytest.approx(1 / 3)
    assert task.score(prompt, [*right[:2], EOS, 50]) == 1.0
    assert task.score(prompt, [EOS]) == 0.0
    # a wrong token still lets the next one count from it
    assert task.score(prompt, [digit_token((last + 5) % 10), digit_token((last + 6) % 10)]) == 0.5


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "raise RuntimeError('no network')",
            "raised RuntimeError: no network (prompt 0, response 'abc', answer '7')",
        ),
        (
            "return float('nan')",
            "returned nan (float); it must return a finite number (prompt 0, response 'abc', ",
        ),
        ("return 'yes'", "returned 'yes' (str); it must return a finite number (prompt 0, response 'abc', "),
        ("return None", "returned None (NoneType); it must return a finite number (prompt 0, "),
    ],
    ids=["raises", "nan", "string", "none"],
)
def test_a_misbehaving_reward_function_is_named_with_its_input(tmp_path, monkeypatch, body, expected):
    from moe_rl.errors import RewardFunctionError
    from moe_rl.rewards.tasks import Prompt

    module = f"user_reward_{len(body)}_{sum(map(ord, body))}"  # a fresh module per case
    (tmp_path / f"{module}.py").write_text(f"def score(response, answer):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = ByteTokenizer()
    scorer = RewardScorer(f"{module}:score", tokenizer=tok)
    prompt = Prompt(ids=tuple(tok.encode("q")), answer="7")
    with pytest.raises(RewardFunctionError) as err:
        scorer.score(prompt, tok.encode("abc")[1:])
    assert str(err.value).startswith(f"reward function data.reward={module}:score ")
    assert expected in str(err.value)
