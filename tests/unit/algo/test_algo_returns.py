"""moe_rl.algo.returns and moe_rl.algo.value: token rewards, GAE, REINFORCE++, the batch whitening
and the clipped value loss, against hand-computed values; GAE's and the scan's properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.algo import registry
from moe_rl.algo.advantages import dr_grpo, outcome
from moe_rl.algo.modes import Advantage, KLEstimator
from moe_rl.algo.returns import (
    WHITEN_EPS,
    discounted_returns,
    gae,
    gae_estimate,
    reinforce_pp_estimate,
    reverse_discounted_sum,
    token_rewards,
    whiten,
    whiten_sums,
)
from moe_rl.algo.value import value_loss
from tests.unit.algo.algo_testing import all_true, grad_of, seq_ids_for, t

SETTINGS = settings(max_examples=40, deadline=None)


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    seq_ids = seq_ids_for([2, 3])
    kl = t([0.1, 0.2, 0.3, 0.0, -0.1])
    got = token_rewards(t([1.0, 0.5]), seq_ids, num_seqs=2, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(got, t([-0.05, 1.0 - 0.1, -0.15, 0.0, 0.5 + 0.05]))
    plain = token_rewards(t([1.0, 0.5]), seq_ids, num_seqs=2)
    torch.testing.assert_close(plain, t([0.0, 1.0, 0.0, 0.0, 0.5]))


def test_gae_hand_values_two_packed_responses():
    """γ = 0.9, λ = 0.5 (γλ = 0.45). Response 0: r = [0, 0, 1], V = [0.5, 0.4, 0.8]:
    δ = [0.9·0.4 − 0.5, 0.9·0.8 − 0.4, 1 − 0.8] = [−0.14, 0.32, 0.2];
    A = [−0.14 + 0.45·0.41, 0.32 + 0.45·0.2, 0.2] = [0.0445, 0.41, 0.2].
    Response 1: r = [0, 2], V = [1, 1]: δ = [0.9 − 1, 2 − 1]; A = [−0.1 + 0.45, 1] (no value leaks
    across the boundary). Returns = A + V."""
    rewards, values = t([0.0, 0.0, 1.0, 0.0, 2.0]), t([0.5, 0.4, 0.8, 1.0, 1.0])
    adv, ret = gae(rewards, values, seq_ids_for([3, 2]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, t([0.0445, 0.41, 0.2, 0.35, 1.0]))
    torch.testing.assert_close(ret, t([0.5445, 0.81, 1.0, 1.35, 2.0]))


def test_gae_one_token_response_and_discounted_returns():
    adv, ret = gae(t([3.0]), t([1.0]), seq_ids_for([1]), gamma=0.7, lam=0.3)
    assert adv.tolist() == [2.0] and ret.tolist() == [3.0]
    # G = [1 + 0.5·(2 + 0.5·4), 2 + 0.5·4, 4]; a new response starts at token 3
    got = discounted_returns(t([1.0, 2.0, 4.0, 8.0]), seq_ids_for([3, 1]), gamma=0.5)
    torch.testing.assert_close(got, t([3.0, 4.0, 4.0, 8.0]))


def test_whitening_from_sums_added_over_parts():
    """x = [1, 2, 3, 4]: mean 2.5, unbiased variance 5/3; the sums of two parts give the same."""
    x, mask = t([1.0, 2.0, 3.0, 4.0]), all_true(4)
    expected = (x - 2.5) / math.sqrt(5 / 3 + 1e-8)
    sums = whiten_sums(x[:2], mask[:2]) + whiten_sums(x[2:], mask[2:])
    assert sums.tolist() == [4.0, 10.0, 30.0]
    torch.testing.assert_close(
        torch.cat([whiten(x[:2], mask[:2], sums), whiten(x[2:], mask[2:], sums)]), expected
    )
    # an uncounted token is 0 and does not move the statistics
    masked = torch.tensor([True, True, False, True, True])
    x5 = t([1.0, 2.0, 99.0, 3.0, 4.0])
    got = whiten(x5, masked, whiten_sums(x5, masked))
    torch.testing.assert_close(got, torch.cat([expected[:2], t([0.0]), expected[2:]]))
    # equal values and a single token whiten to 0
    assert whiten(t([2.0, 2.0]), all_true(2), whiten_sums(t([2.0, 2.0]), all_true(2))).tolist() == [0.0, 0.0]
    assert whiten(t([5.0]), all_true(1), whiten_sums(t([5.0]), all_true(1))).tolist() == [0.0]


def test_reinforce_pp_advantage_statistics_equal_a_hand_computation():
    """REINFORCE++ on 4 responses (groups [0, 0, 1, 1], rewards [1, 0, 1, 1], lengths [2, 1, 2, 1]),
    KL k1 = old − ref per token, β = 0.1, γ = 1: token rewards, returns-to-go, then whitening over
    all 6 tokens of the batch. Its group-baseline variant starts from R − mean_g R = [½, −½, 0, 0]."""
    rewards, groups = t([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    seq_ids = seq_ids_for([2, 1, 2, 1])
    old, ref = t([-1.0, -2.0, -1.0, -0.5, -0.5, -3.0]), t([-1.5, -1.0, -1.0, -1.5, -0.5, -2.0])
    # old − ref = [0.5, -1.0, 0.0, 1.0, 0.0, -1.0] (k1)
    # token rewards: −0.1·kl, and the response's score on its last token
    r = [-0.05, 1 + 0.1, 0.0, -0.1, 1 + 0.0, 1 + 0.1]
    g = [r[0] + r[1], r[1], r[2], r[3] + r[4], r[4], r[5]]  # γ = 1: returns-to-go per response
    assert g == pytest.approx([1.05, 1.1, 0.0, 0.9, 1.0, 1.1])
    mean = sum(g) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 5)
    bound = registry.bind_token_advantage(
        Advantage.REINFORCE_PP, {"gamma": 1.0, "lam": 0.95}, 0.1, KLEstimator.K1, in_reward=True
    )
    scores = registry.bind_advantage(Advantage.REINFORCE_PP)(rewards=rewards, group_ids=groups)
    out = bound(scores=scores, seq_ids=seq_ids, num_seqs=4, old_logp=old, ref_logp=ref)
    torch.testing.assert_close(out.rewards, t(r))
    torch.testing.assert_close(out.advantages, t(g))
    whitened = whiten(out.advantages, all_true(6), whiten_sums(out.advantages, all_true(6)))
    torch.testing.assert_close(whitened, (t(g) - mean) / math.sqrt(std**2 + 1e-8))
    assert float(whitened.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(whitened.std()) == pytest.approx(1.0, abs=1e-6)
    # the group-baseline variant: scores less the group mean, the same KL rewards
    base = registry.bind_advantage(Advantage.REINFORCE_PP_BASELINE)(rewards=rewards, group_ids=groups)
    assert base.tolist() == [0.5, -0.5, 0.0, 0.0]
    out = reinforce_pp_estimate(base, seq_ids, num_seqs=4, gamma=1.0, old_logp=old, ref_logp=ref, kl_coef=0.1)
    # token rewards [−0.05, ½ + 0.1 | −½ | −0.1, 0 | 0 + 0.1], returns-to-go per response
    torch.testing.assert_close(out.advantages, t([0.55, 0.6, -0.5, -0.1, 0.0, 0.1]))


def test_gae_estimate_without_kl_needs_no_reference_and_refuses_k3_is():
    seq_ids = seq_ids_for([2])
    out = gae_estimate(t([1.0]), seq_ids, num_seqs=1, values=t([0.0, 0.0]), gamma=1.0, lam=1.0)
    assert out.advantages.tolist() == [1.0, 1.0] and out.returns.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="needs old_logp and ref_logp"):
        gae_estimate(t([1.0]), seq_ids, num_seqs=1, values=t([0.0, 0.0]), gamma=1.0, lam=1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="'k3_is'"):
        gae_estimate(
            t([1.0]), seq_ids, num_seqs=1, values=t([0.0, 0.0]), gamma=1.0, lam=1.0, kl_coef=0.1,
            old_logp=t([-1.0, -1.0]), ref_logp=t([-1.0, -1.0]), kl_estimator=KLEstimator.K3_IS,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"lam must be a number in \[0, 1\]"):
        gae(t([1.0]), t([0.0]), seq_ids_for([1]), gamma=1.0, lam=1.5)


def test_token_advantage_bindings():
    groups = torch.tensor([0, 0])
    for adv in (Advantage.GRPO, Advantage.DR_GRPO, Advantage.RLOO):
        assert (
            registry.bind_token_advantage(adv, {"gamma": 1.0, "lam": 1.0}, 0.1, KLEstimator.K1, True) is None
        )
    assert outcome(t([0.25, 1.0]), groups).tolist() == [0.25, 1.0]
    gae_bound = registry.bind_token_advantage(
        Advantage.GAE, {"gamma": 0.9, "lam": 0.5}, 0.3, KLEstimator.K3, False
    )
    assert dict(gae_bound.values) == {
        "gamma": 0.9,
        "lam": 0.5,
        "kl_coef": 0.0,
        "kl_estimator": KLEstimator.K3,
    }
    assert "values" in gae_bound.inputs
    with pytest.raises(ValueError, match=r"needs inputs \['values'\]"):
        gae_bound(scores=t([1.0]), seq_ids=seq_ids_for([1]), num_seqs=1)
    pp = registry.bind_token_advantage(
        Advantage.REINFORCE_PP, {"gamma": 1.0, "lam": 1.0}, 0.3, KLEstimator.K1, True
    )
    assert pp.values["kl_coef"] == 0.3 and "values" not in pp.inputs
    assert registry.DRIVER_FUNCS[Advantage.REINFORCE_PP_BASELINE] == "dr_grpo"
    torch.testing.assert_close(dr_grpo(t([1.0, 0.0]), groups), t([0.5, -0.5]))
    assert set(registry.DRIVER_FUNCS) == set(Advantage)


def test_value_loss_hand_values_clip_and_gradient():
    """Token 0: V = 1 moved 0.2 from V_old = 0.8, clipped to 0.9; (0.9 − 2)² = 1.21 > (1 − 2)² = 1,
    so the clipped term counts and its gradient is 0 (the clip saturates). Token 1: V = 0.45 moved
    −0.05, inside the clip: ½(0.45 − 0.2)² = 0.03125, gradient V − R = 0.25."""
    values = t([1.0, 0.45], requires_grad=True)
    out = value_loss(
        values, t([0.8, 0.5]), t([2.0, 0.2]), all_true(2), seq_ids_for([1, 1]), num_seqs=2, clip=0.1
    )
    assert float(out.loss_sum.detach()) == pytest.approx(0.5 * 1.21 + 0.03125)
    assert float(out.denom) == 2.0
    assert float(out.metrics["clip_frac"]) == 0.5
    assert float(out.metrics["abs_error"]) == pytest.approx((1.0 + 0.25) / 2)
    torch.testing.assert_close(grad_of(out.loss_sum, values), t([0.0, 0.25]))
    unclipped = value_loss(
        values, t([0.8, 0.5]), t([2.0, 0.2]), all_true(2), seq_ids_for([2]), num_seqs=1, clip=math.inf
    )
    assert float(unclipped.loss_sum.detach()) == pytest.approx(0.5 * 1.0 + 0.03125)
    for bad in (0.0, -1.0, math.nan, "0.2"):  # a NaN compares False with everything: named on its own
        with pytest.raises(ValueError, match=r"clip must be > 0 \(inf: no clip\), got "):
            value_loss(values, values, values, all_true(2), seq_ids_for([2]), num_seqs=1, clip=bad)


# ---------------------------------------------------------------------------- properties


@st.composite
def responses(draw, max_seqs: int = 5, max_len: int = 9):
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    n = sum(lengths)
    vec = st.lists(st.floats(-5.0, 5.0), min_size=n, max_size=n)
    return lengths, t(draw(vec)), t(draw(vec))


def _sequential(x: list[float], lengths: list[int], coef: float) -> list[float]:
    """The recurrence y_t = x_t + coef·y_{t+1}, response by response, backwards (the reference)."""
    out, start = [], 0
    for n in lengths:
        ys, running = [], 0.0
        for v in reversed(x[start : start + n]):
            running = v + coef * running
            ys.append(running)
        out += ys[::-1]
        start += n
    return out


@SETTINGS
@given(b=responses(), coef=st.floats(0.0, 1.0))
def test_scan_equals_the_sequential_recurrence(b, coef):
    lengths, x, _ = b
    got = reverse_discounted_sum(x, seq_ids_for(lengths), coef=coef)
    torch.testing.assert_close(got, t(_sequential(x.tolist(), lengths, coef)), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(b=responses())
def test_gae_with_lambda_and_gamma_one_is_return_minus_value(b):
    lengths, rewards, values = b
    adv, ret = gae(rewards, values, seq_ids_for(lengths), gamma=1.0, lam=1.0)
    returns_to_go = t(_sequential(rewards.tolist(), lengths, 1.0))
    torch.testing.assert_close(adv, returns_to_go - values)
    torch.testing.assert_close(ret, returns_to_go)


@SETTINGS
@given(b=responses(), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_with_lambda_zero_is_the_td_error_and_returns_are_advantage_plus_value(b, gamma, lam):
    lengths, rewards, values = b
    seq_ids = seq_ids_for(lengths)
    adv0, _ = gae(rewards, values, seq_ids, gamma=gamma, lam=0.0)
    nxt = [values[i + 1].item() if i + 1 < len(seq_ids) and seq_ids[i + 1] == seq_ids[i] else 0.0
           for i in range(len(seq_ids))]  # fmt: skip
    torch.testing.assert_close(adv0, rewards + gamma * t(nxt) - values)
    adv, ret = gae(rewards, values, seq_ids, gamma=gamma, lam=lam)
    torch.testing.assert_close(ret, adv + values)


@SETTINGS
@given(b=responses(), cut=st.integers(0, 45))
def test_whitening_does_not_depend_on_how_the_batch_is_split(b, cut):
    _, x, _ = b
    cut = min(cut, x.numel())
    mask = all_true(x.numel())
    whole = whiten(x, mask, whiten_sums(x, mask))
    sums = whiten_sums(x[:cut], mask[:cut]) + whiten_sums(x[cut:], mask[cut:])
    parts = torch.cat([whiten(x[:cut], mask[:cut], sums), whiten(x[cut:], mask[cut:], sums)])
    torch.testing.assert_close(parts, whole)
    if x.numel() > 1 and float(x.std()) > 1e-3:
        assert float(whole.mean()) == pytest.approx(0.0, abs=1e-9)
        var = float(x.double().var())  # ε under the root: the spread is sqrt(var / (var + ε)), not 1
        assert float(whole.std()) == pytest.approx((var / (var + WHITEN_EPS)) ** 0.5, rel=1e-6)


def test_whitening_a_near_constant_batch_puts_eps_under_the_root():
    """x = [1, 1 + 2e-5]: mean 1 + 1e-5, unbiased variance 2e-10, far below ε = 1e-8. Under the
    root, ε dominates: ±1e-5 / sqrt(2e-10 + 1e-8) = ±0.0990 (added to the standard deviation it
    would give ±0.7066; without it, ±0.7071)."""
    x = torch.tensor([1.0, 1.0 + 2e-5], dtype=torch.float64)
    mask = all_true(2)
    got = whiten(x, mask, whiten_sums(x, mask))
    d = float(x[1] - x[0]) / 2  # what float64 holds of 1e-5
    expected = d / math.sqrt(2 * d * d + WHITEN_EPS)
    assert got.tolist() == pytest.approx([-expected, expected], rel=1e-6)
    assert expected == pytest.approx(0.0990, abs=1e-4)
    assert whiten(x, mask, whiten_sums(x, mask), eps=0.0).tolist() == pytest.approx(
        [-(0.5**0.5), 0.5**0.5], rel=1e-5
    )  # the variance from sums of squares near 1 keeps about 6 of its digits


def test_a_constant_batch_whose_sums_round_to_a_negative_variance_whitens_to_zero():
    """3,001 equal tokens of 89378.3984375: Σx² and n·mean² round apart in float64 and their
    difference is about −1.3e-6, below −ε; the variance is clamped at 0, so every token whitens to
    0, not to NaN."""
    x = torch.full((3001,), 89378.3984375)
    mask = all_true(3001)
    count, total, squares = whiten_sums(x, mask).unbind()
    assert float((squares - count * (total / count) ** 2) / (count - 1)) < -WHITEN_EPS  # the round-off
    got = whiten(x, mask, whiten_sums(x, mask))
    assert torch.equal(got, torch.zeros_like(x))


def test_rates_and_the_kl_coefficient_are_refused_below_zero_and_taken_at_zero():
    """The boundary pairs: a discount or λ of exactly 0 and 1 works, −0.5 is refused; a KL
    coefficient of exactly 0 works, −0.5 is refused."""
    x, seq = t([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0])
    assert reverse_discounted_sum(x, seq, coef=0.0).tolist() == [1.0, 2.0, 3.0]
    assert reverse_discounted_sum(x, seq, coef=1.0).tolist() == [6.0, 5.0, 3.0]
    with pytest.raises(ValueError, match=r"coef must be a number in \[0, 1\], got -0.5"):
        reverse_discounted_sum(x, seq, coef=-0.5)
    scores = t([2.0])
    assert token_rewards(scores, seq, num_seqs=1, kl=t([1.0, 1.0, 1.0]), kl_coef=0).tolist() == [
        0.0,
        0.0,
        2.0,
    ]
    with pytest.raises(ValueError, match=r"kl_coef must be a number >= 0, got -0.5"):
        token_rewards(scores, seq, num_seqs=1, kl=t([1.0, 1.0, 1.0]), kl_coef=-0.5)


def test_without_a_kl_coefficient_the_reward_carries_no_kl_and_with_one_it_needs_both_log_probs():
    """The default coefficient is 0: a KL given, or log-probs given, put nothing in the reward. With
    a coefficient, π_old's and π_ref's log-probs are both needed: either one missing is refused."""
    seq, scores = torch.tensor([0, 0, 1]), t([1.0, 0.5])
    assert token_rewards(scores, seq, num_seqs=2, kl=t([3.0, 3.0, 3.0])).tolist() == [0.0, 1.0, 0.5]
    old, ref = t([-1.0, -2.0, -0.5]), t([-1.5, -1.0, -0.5])
    plain = reinforce_pp_estimate(scores, seq, num_seqs=2, gamma=1.0, old_logp=old, ref_logp=ref)
    assert plain.rewards.tolist() == [0.0, 1.0, 0.5]
    for one in ({"old_logp": old}, {"ref_logp": ref}):
        with pytest.raises(
            ValueError, match=r"kl_coef=0.1 puts the KL in the reward: it needs old_logp and ref_logp"
        ):
            reinforce_pp_estimate(scores, seq, num_seqs=2, gamma=1.0, kl_coef=0.1, **one)
