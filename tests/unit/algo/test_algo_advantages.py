"""moe_rl.algo.advantages: GRPO, Dr.GRPO, RLOO, zero-variance report, RL-ZVP."""

import math

import pytest
import torch

from moe_rl.algo.advantages import (
    dr_grpo,
    grpo,
    rloo,
    zero_variance_groups,
    zero_variance_signs,
    zvp_shape,
)
from tests.unit.algo.algo_testing import seq_ids_for, t

S2 = 1 / math.sqrt(2)  # (1 − 0.5) / std([1, 0]) with the unbiased std √0.5


@pytest.mark.parametrize(
    ("rewards", "groups", "expected"),
    [
        ([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [S2, -S2, 0.0, 0.0]),
        ([1.0, 1.0, 0.0, 0.0], [7, 3, 7, 3], [S2, S2, -S2, -S2]),  # interleaved, arbitrary ids
        ([2.0, 0.0, 1.0], [0, 0, 0], [1.0, -1.0, 0.0]),  # mean 1, std 1
        ([5.0], [0], [0.0]),  # a group of one
    ],
    ids=["two-groups", "interleaved-ids", "three-members", "singleton"],
)
def test_grpo_hand_values(rewards, groups, expected):
    got = grpo(t(rewards), torch.tensor(groups), eps=0.0)
    torch.testing.assert_close(got, t(expected))


def test_grpo_eps_is_added_to_std():
    got = grpo(t([1.0, 0.0]), torch.tensor([0, 0]), eps=0.5)
    torch.testing.assert_close(got, t([0.5 / (S2 + 0.5), -0.5 / (S2 + 0.5)]))


@pytest.mark.parametrize(
    ("fn", "expected"),
    [(dr_grpo, [2 / 3, -1 / 3, -1 / 3, 0.5, -0.5]), (rloo, [1.0, -0.5, -0.5, 1.0, -1.0])],
    ids=["dr_grpo", "rloo"],
)
def test_mean_baselines_hand_values(fn, expected):
    # group 0: [1, 0, 0] (mean 1/3; leave-one-out means 0, 1/2, 1/2); group 1: [3, 2]
    got = fn(t([1.0, 0.0, 0.0, 3.0, 2.0]), torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(got, t(expected))


def test_rloo_singleton_group_is_zero():
    torch.testing.assert_close(rloo(t([4.0]), torch.tensor([0])), t([0.0]))


def test_zero_variance_report_counts_groups_with_equal_rewards():
    rewards = t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    report = zero_variance_groups(rewards, torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert int(report.num_groups) == 4
    assert int(report.num_zero_variance) == 3  # all-ones, all-zeros, singleton
    assert report.seq_zero_variance.tolist() == [True, True, False, False, True, True, True]
    assert report.metrics()["zero_variance_group_share"].item() == pytest.approx(0.75)


def test_rl_zvp_hand_values_and_no_gradient_through_entropy():
    """RL-ZVP as the loop runs it: the signs over the batch, then the shaping per micro-batch."""
    # seq 0: group 0 all-correct; seq 1: group 1 all-wrong; seqs 2, 3: mixed group 2
    lengths = [2, 3, 1, 1]
    seq_ids = seq_ids_for(lengths)
    rewards = t([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 1, 2, 2])
    base = t([0.0, 0.0, 0.7, -0.7])[seq_ids]
    entropy = t([0.5, 2.0, 1.0, 3.0, 0.4, 9.0, 9.0], requires_grad=True)
    mask = torch.tensor([True, True, True, True, False, True, True])  # token 4 not counted
    signs = zero_variance_signs(rewards, groups)
    assert signs.tolist() == [1, -1, 0, 0] and signs.dtype == torch.int8
    got = zvp_shape(base, entropy, mask, seq_ids, num_seqs=4, signs=signs, alpha=0.1)
    # all-correct: 0.1·H; all-wrong: −0.1·(max H − H) with max over counted tokens (3.0)
    expected = [0.05, 0.2, -0.1 * (3.0 - 1.0), -0.1 * (3.0 - 3.0), 0.0, 0.7, -0.7]
    torch.testing.assert_close(got, t(expected))
    assert not got.requires_grad


@pytest.mark.parametrize(
    ("rewards", "groups", "match"),
    [([1.0, 0.0], [0], "group_ids must have 2 elements"), ([1, 0], [0, 0], "rewards must be a float")],
    ids=["length-mismatch", "int-rewards"],
)
def test_advantages_reject_bad_input(rewards, groups, match):
    with pytest.raises(ValueError, match=match):
        grpo(torch.tensor(rewards), torch.tensor(groups))
