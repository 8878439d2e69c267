"""moe_rl.algo.objectives: PPO-clip, GSPO, GSPO-token, CISPO, REINFORCE, DGO (ESPO has its own file)."""

import math

import pytest
import torch

from moe_rl.algo.objectives import (
    cispo,
    dgo,
    dgo_weights,
    gspo,
    gspo_token,
    ppo_clip,
    reinforce,
    weighted_sft,
)
from tests.unit.algo.algo_testing import all_true, grad_of, seq_ids_for, t

# --- PPO-clip ---------------------------------------------------------------------------------

PPO_CASES = [
    # ratio, A, eps_low, eps_high, expected loss, expected d loss / d logp
    (1.1, 1.0, 0.2, 0.2, -1.1, -1.1),  # inside the band: −r·A, gradient −r·A
    (1.5, 1.0, 0.2, 0.2, -1.2, 0.0),  # A > 0 above 1+ε: clipped, no gradient
    (0.5, 1.0, 0.2, 0.2, -0.5, -0.5),  # A > 0 below 1−ε: min picks r·A, gradient kept
    (0.5, -1.0, 0.2, 0.2, 0.8, 0.0),  # A < 0 below 1−ε: clipped
    (2.0, -1.0, 0.2, 0.28, 2.0, 2.0),  # A < 0 above: r·A, under the dual-clip cap 3
    (10.0, -1.0, 0.2, 0.2, 3.0, 0.0),  # dual clip: capped at c·|A| = 3
    (1.3, 2.0, 0.2, 0.28, -2.56, 0.0),  # asymmetric high side: 1.28·2
]


@pytest.mark.parametrize(
    ("ratio", "adv", "eps_low", "eps_high", "loss", "grad"),
    PPO_CASES,
    ids=["inside", "pos-clipped-high", "pos-below", "neg-clipped-low", "neg-above", "dual-clip", "asym-high"],
)
def test_ppo_clip_hand_values(ratio, adv, eps_low, eps_high, loss, grad):
    logp = t([math.log(ratio) - 1.0], requires_grad=True)
    out = ppo_clip(
        logp, t([-1.0]), t([adv]), all_true(1), seq_ids_for([1]), num_seqs=1,
        clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=3.0,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(loss, abs=1e-9)
    assert grad_of(out.loss, logp).item() == pytest.approx(grad, abs=1e-9)


def test_ppo_clip_metrics_and_token_mean():
    ratios = [1.1, 1.5, 0.5, 10.0]
    logp = t([math.log(r) for r in ratios])
    mask = torch.tensor([True, True, True, True])
    out = ppo_clip(logp, t([0.0] * 4), t([1.0, 1.0, -1.0, -1.0]), mask, seq_ids_for([4]), num_seqs=1)
    # per-token losses −1.1, −1.2, 0.8, 3.0 (dual clip)
    assert out.loss_sum.item() == pytest.approx(-1.1 - 1.2 + 0.8 + 3.0)
    assert out.denom.item() == 4
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 4)  # tokens 1 and 2
    assert out.metrics["dual_clip_frac"].item() == pytest.approx(1 / 4)


def test_ppo_clip_without_dual_clip_is_unbounded_for_negative_advantages():
    out = ppo_clip(
        t([math.log(10.0)]), t([0.0]), t([-1.0]), all_true(1), seq_ids_for([1]), num_seqs=1, dual_clip_c=None
    )
    assert out.loss.item() == pytest.approx(10.0)


def test_ppo_clip_correction_weights_are_detached_and_multiply_the_loss():
    weights = t([0.5, 2.0], requires_grad=True)
    logp = t([0.0, 0.0], requires_grad=True)
    out = ppo_clip(
        logp, t([0.0, 0.0]), t([1.0, 1.0]), all_true(2), seq_ids_for([2]), num_seqs=1, weights=weights
    )
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    torch.testing.assert_close(grad_of(out.loss, logp), t([-0.25, -1.0]))
    assert torch.autograd.grad(out.loss, weights, allow_unused=True)[0] is None


# --- GSPO / GSPO-token ------------------------------------------------------------------------


def _two_token_seq(a: float, b: float):
    logp = t([a, b], requires_grad=True)
    return logp, t([0.0, 0.0]), all_true(2), seq_ids_for([2])


@pytest.mark.parametrize("fn", [gspo, gspo_token], ids=["gspo", "gspo_token"])
def test_gspo_value_is_the_clipped_geometric_mean_ratio(fn):
    logp, old, mask, seq = _two_token_seq(2e-4, 0.0)  # s = exp(1e-4), inside (1−3e-4, 1+4e-4)
    out = fn(logp, old, t([1.0, 1.0]), mask, seq, num_seqs=1)
    assert out.loss.item() == pytest.approx(-math.exp(1e-4), abs=1e-12)
    # both: d/dlogp_t of −s·A = −s/2 per token (GSPO through the mean; GSPO-token through s_t)
    torch.testing.assert_close(grad_of(out.loss, logp), t([-math.exp(1e-4) / 2] * 2))
    logp, old, mask, seq = _two_token_seq(2e-3, 0.0)  # s = exp(1e-3) > 1+4e-4: clipped
    out = fn(logp, old, t([1.0, 1.0]), mask, seq, num_seqs=1)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-12)
    assert torch.all(grad_of(out.loss, logp) == 0)


def test_gspo_has_cross_token_gradient_and_gspo_token_does_not():
    s = math.exp(5e-5)
    adv = t([1.0, 0.0])  # token-level advantages differ inside the response
    logp, old, mask, seq = _two_token_seq(1e-4, 0.0)
    g_seq = grad_of(gspo(logp, old, adv, mask, seq, num_seqs=1).loss, logp)
    g_tok = grad_of(gspo_token(logp, old, adv, mask, seq, num_seqs=1).loss, logp)
    # GSPO: loss = −(1/2)·s·1; ds/dlogp_t = s/2 for both tokens
    torch.testing.assert_close(g_seq, t([-s / 4, -s / 4]))
    # GSPO-token: token t's gradient is −A_t·s/2 only (stop-gradient on the sequence mean)
    torch.testing.assert_close(g_tok, t([-s / 2, 0.0]))


def test_gspo_ignores_masked_tokens_in_the_sequence_ratio():
    logp = t([1e-4, 50.0])
    mask = torch.tensor([True, False])
    out = gspo(logp, t([0.0, 0.0]), t([1.0, 1.0]), mask, seq_ids_for([2]), num_seqs=1)
    assert out.loss.item() == pytest.approx(-math.exp(1e-4), abs=1e-12)


@pytest.mark.parametrize("fn", [gspo, gspo_token], ids=["gspo", "gspo_token"])
def test_gspo_on_one_token_sequences_equals_token_ppo(fn):
    torch.manual_seed(0)
    n = 6
    logp = (0.3 * torch.randn(n, dtype=torch.float64)).requires_grad_()
    old, adv = 0.3 * torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    seq, mask = torch.arange(n), all_true(n)
    a = fn(
        logp, old, adv, mask, seq, num_seqs=n, gspo_eps_low=0.2, gspo_eps_high=0.2, aggregation="token_mean"
    )
    b = ppo_clip(logp, old, adv, mask, seq, num_seqs=n, dual_clip_c=None)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(grad_of(a.loss, logp), grad_of(b.loss, logp))


# --- CISPO, REINFORCE -------------------------------------------------------------------------


def test_cispo_hand_value_and_gradient_survives_clipping():
    logp = t([math.log(1.5) - 1.0, math.log(0.9) - 1.0], requires_grad=True)
    old = t([-1.0, -1.0], requires_grad=True)
    adv = t([2.0, -1.0])
    out = cispo(logp, old, adv, all_true(2), seq_ids_for([2]), num_seqs=1)
    # weights sg(clip(r)) = 1.2 (clipped) and 0.9
    expected = (-1.2 * 2.0 * logp[0] - 0.9 * -1.0 * logp[1]).item() / 2
    assert out.loss.item() == pytest.approx(expected)
    torch.testing.assert_close(grad_of(out.loss, logp), t([-1.2, 0.45]))
    assert torch.all(grad_of(out.loss, old) == 0)  # the IS weight is detached
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)


def test_cispo_without_lower_bound():
    out = cispo(
        t([math.log(0.1)]), t([0.0]), t([1.0]), all_true(1), seq_ids_for([1]), num_seqs=1, clip_eps_low=None
    )
    assert out.loss.item() == pytest.approx(-0.1 * math.log(0.1))


def test_reinforce_hand_value_with_weights():
    logp = t([-1.0, -2.0], requires_grad=True)
    out = reinforce(logp, t([1.0, -0.5]), all_true(2), seq_ids_for([2]), num_seqs=1, weights=t([2.0, 1.0]))
    assert out.loss.item() == pytest.approx((2.0 - 1.0) / 2)  # −A·logp·w = 2 and −1
    torch.testing.assert_close(grad_of(out.loss, logp), t([-1.0, 0.25]))


# --- DGO --------------------------------------------------------------------------------------


def test_dgo_weights_hand_values_and_overflow_safety():
    e = math.e
    got = dgo_weights(t([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), dgo_beta=1.0)
    torch.testing.assert_close(got, torch.tensor([2 * e / (e + 1), 2 / (e + 1), 1.0]))
    big = dgo_weights(t([1000.0, 0.0]), torch.tensor([0, 0]), dgo_beta=0.1)
    torch.testing.assert_close(big, torch.tensor([2.0, 0.0]))


def test_dgo_is_weighted_sft_on_sequence_log_likelihood():
    logp = t([-1.0, -2.0, -0.5], requires_grad=True)
    seq = seq_ids_for([2, 1])
    out = dgo(
        logp,
        all_true(3),
        seq,
        num_seqs=2,
        rewards=t([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        dgo_beta=1.0,
    )
    w = [2 * math.e / (math.e + 1), 2 / (math.e + 1)]
    assert out.loss.item() == pytest.approx((w[0] * 3.0 + w[1] * 0.5) / 2, rel=1e-6)
    torch.testing.assert_close(
        grad_of(out.loss, logp), t([-w[0] / 2, -w[0] / 2, -w[1] / 2]), rtol=1e-6, atol=1e-7
    )
    again = weighted_sft(logp, all_true(3), seq, num_seqs=2, seq_weights=torch.tensor(w))
    torch.testing.assert_close(again.loss, out.loss)


# --- input checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"loss_mask": torch.ones(2)}, "loss_mask must be torch.bool"),
        ({"seq_ids": torch.zeros(2, dtype=torch.int32)}, "seq_ids must be torch.long"),
        ({"advantages": t([1.0])}, "advantages must have 2 elements"),
        ({"clip_eps_low": 1.5}, "clip_eps_low"),
        ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1"),
        ({"num_seqs": -1}, "num_seqs"),
        ({"aggregation": "mean"}, "aggregation must be one of"),
    ],
    ids=[
        "float-mask",
        "int32-seq-ids",
        "short-advantages",
        "eps-low",
        "dual-clip",
        "num-seqs",
        "aggregation",
    ],
)
def test_ppo_clip_rejects_bad_input(override, match):
    args = {
        "logp": t([0.0, 0.0]), "old_logp": t([0.0, 0.0]), "advantages": t([1.0, 1.0]),
        "loss_mask": all_true(2), "seq_ids": seq_ids_for([2]), "num_seqs": 1,
    }  # fmt: skip
    args.update(override)
    with pytest.raises(ValueError, match=match):
        ppo_clip(**args)
