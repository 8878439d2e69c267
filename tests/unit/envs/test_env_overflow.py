"""An environment answer longer than what is left of `env.max_tokens` is never dropped silently:
`env.overflow=truncate` writes the tokens that fit, ends the trajectory and counts it in
`env/truncated_share`; `refuse` stops with one line naming the environment, the trajectory and the
lengths. Before, the answer vanished (the trajectory ended with no environment token, nothing
counted). The turn loop runs as in a run, its model turns written by the SFT demonstrator (a
rollout engine that writes instead of sampling); a `moe-rl train` run of each:
tests/e2e/test_env_overflow.py."""

from __future__ import annotations

import pytest

from moe_rl.config.modes import EnvOverflow
from moe_rl.envs.base import Environment, StepResult
from moe_rl.envs.rollout import MultiTurnRollout, TurnLimits, env_metrics
from moe_rl.errors import EnvError
from moe_rl.orchestration.sft import Demonstrator
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec

TURN = [7, 8, 9]  # every model turn: three tokens
VOCAB = 32


class _Answers(Environment):
    """Answers the first model turn with ``length`` tokens, ends the episode at the second."""

    def __init__(self, length: int):
        self.length, self.steps = length, 0

    def step(self, turn: list[int]) -> StepResult:
        self.steps += 1
        if self.steps == 1:
            return StepResult([20 + i % 10 for i in range(self.length)], tool_calls=1)
        return StepResult(reward=1.0, done=True)


def _rollout(
    answer: int, max_tokens: int, overflow: EnvOverflow = EnvOverflow.TRUNCATE, trajectories: int = 2
):
    limits = TurnLimits(max_turns=3, max_tokens=max_tokens, max_prompt_len=8, overflow=overflow)
    loop = MultiTurnRollout(
        Demonstrator(lambda context: TURN), lambda: _Answers(answer), limits, VOCAB, "answers"
    )
    return loop.generate([Prompt((1, 2), (3,))] * trajectories, SamplingSpec(max_new_tokens=4))


def test_an_answer_longer_than_the_budget_left_is_truncated_and_counted():
    batch, stats = _rollout(answer=12, max_tokens=10)
    metrics = env_metrics([stats])
    for i in range(batch.num_samples):
        s = batch.sample(i)
        # the model's turn, the first 6 of the 12 answer tokens, the model's last token: 10
        assert s.response_ids.tolist() == [*TURN, *range(20, 26), TURN[0]]
        assert s.sampled.tolist() == [True] * 3 + [False] * 6 + [True] and s.finish_reason == "stop"
    assert metrics["env/truncated_share"] == 1.0 and metrics["env/done_share"] == 1.0


def test_an_answer_that_fits_is_written_whole_and_not_counted():
    batch, stats = _rollout(answer=5, max_tokens=12)
    s = batch.sample(0)  # turn, answer, the last turn within the 4 tokens left, then done
    assert s.response_ids.tolist() == [*TURN, *range(20, 25), *TURN] and s.finish_reason == "stop"
    assert env_metrics([stats])["env/truncated_share"] == 0.0


def test_an_answer_that_leaves_the_model_one_token_fits():
    batch, stats = _rollout(answer=6, max_tokens=10)
    assert batch.sample(0).response_ids.tolist() == [*TURN, *range(20, 26), TURN[0]]
    assert env_metrics([stats])["env/truncated_share"] == 0.0


def test_no_answer_is_written_after_a_turn_that_spent_the_budget():
    """The model's own turn reached the budget: no model turn could read an answer, as after the
    last turn; that is the trajectory's length, not an overflow of the answer."""
    batch, stats = _rollout(answer=12, max_tokens=3, overflow=EnvOverflow.REFUSE)
    s = batch.sample(0)
    assert s.response_ids.tolist() == TURN and s.finish_reason == "length"
    assert env_metrics([stats])["env/truncated_share"] == 0.0


def test_an_answer_with_no_room_at_all_is_counted():
    """One token left: it is the model's, nothing of the answer fits; the trajectory ends, counted."""
    batch, stats = _rollout(answer=2, max_tokens=4)
    s = batch.sample(0)
    assert s.response_ids.tolist() == TURN and s.finish_reason == "length"
    assert env_metrics([stats])["env/truncated_share"] == 1.0


def test_refuse_stops_with_one_line_naming_the_lengths():
    with pytest.raises(EnvError) as info:
        _rollout(answer=12, max_tokens=10, overflow=EnvOverflow.REFUSE)
    assert str(info.value) == (
        "env answers: an answer of 12 tokens (trajectory 0, after model turn 1) does not fit env.max_tokens=10 "
        "with 3 used (at most 6: the model's next turn needs one); raise env.max_tokens, make the answers "
        "shorter, or set env.overflow=truncate"
    )


def test_the_share_counts_trajectories_over_replicas():
    """Two replicas' counts merged: one truncated trajectory of four."""
    _, one = _rollout(answer=12, max_tokens=10, trajectories=1)
    _, three = _rollout(answer=5, max_tokens=12, trajectories=3)
    assert env_metrics([one, three])["env/truncated_share"] == 0.25
