"""moe_rl.algo.kl: k1, k2, k3, abs and the IS-corrected k3 of DeepSeek-V3.2 Eq. 7."""

import math

import pytest
import torch

from moe_rl.algo import registry
from moe_rl.algo.kl import KL_ESTIMATORS, kl_k3, kl_k3_is, kl_loss, kl_penalty
from moe_rl.algo.modes import Aggregation, KLEstimator
from tests.unit.algo.algo_testing import grad_of, seq_ids_for, t

LOG_R = math.log(0.5)  # ref_logp − logp with π_θ = 0.5, π_ref = 0.25


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", -LOG_R),
        ("k2", 0.5 * LOG_R**2),
        ("k3", 0.5 - LOG_R - 1),
        ("abs", abs(LOG_R)),
        ("k3_is", 2.0 * (0.5 - LOG_R - 1)),  # π_θ/π_old = 0.5/0.25 = 2
    ],
    ids=list(KL_ESTIMATORS),
)
def test_kl_hand_values(estimator, expected):
    got = kl_penalty(
        t([math.log(0.5)]), t([math.log(0.25)]), estimator=estimator, old_logp=t([math.log(0.25)])
    )
    assert got.item() == pytest.approx(expected)


def test_k3_is_has_gradient_through_the_ratio():
    x = t([math.log(0.5)], requires_grad=True)
    ref, old = t([math.log(0.25)]), t([math.log(0.4)])
    g = grad_of(kl_k3_is(x, ref, old).sum(), x).item()
    # f = e^{x−o}·(e^{r−x} − (r−x) − 1) → f' = f + e^{x−o}·(1 − e^{r−x})
    ratio, k3 = 0.5 / 0.4, 0.5 - math.log(0.5) - 1
    assert g == pytest.approx(ratio * k3 + ratio * (1 - 0.5))
    g_detached = grad_of(
        (kl_k3_is(x, ref, old).detach() / kl_k3(x, ref).detach() * kl_k3(x, ref)).sum(), x
    ).item()
    assert g != pytest.approx(g_detached)  # a stop-gradient on the ratio would change it


def test_kl_finite_at_extreme_log_probs():
    logp, ref = t([-80.0, 0.0, -80.0]), t([0.0, -80.0, -80.0])
    for est in KL_ESTIMATORS:
        assert torch.isfinite(kl_penalty(logp, ref, estimator=est, old_logp=ref)).all(), est


def test_kl_rejects_bad_input():
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalty(t([0.0]), t([0.0]), estimator="k4")
    with pytest.raises(ValueError, match="needs old_logp"):
        kl_penalty(t([0.0]), t([0.0]), estimator="k3_is")
    with pytest.raises(ValueError, match="ref_logp shape"):
        kl_penalty(t([0.0]), t([0.0, 1.0]), estimator="k1")


def test_kl_loss_is_coef_times_the_aggregated_penalty():
    logp = t([-1.0, -2.0, -0.5, -1.5, -0.7], requires_grad=True)
    ref = t([-1.2, -1.0, -0.5, -2.5, -0.4])
    mask = torch.tensor([True, True, False, True, True])
    out = kl_loss(
        logp, ref, mask, seq_ids_for([2, 3]), num_seqs=2, estimator="k2", coef=0.5,
        aggregation="seq_mean_token_mean",
    )  # fmt: skip
    # k2 = ½(ref − logp)² = [0.02, 0.5, ·, 0.5, 0.045]; response means 0.26 and 0.2725
    assert out.loss_sum.item() == pytest.approx(0.5 * (0.26 + 0.2725))
    assert out.denom.item() == 2.0
    # d/dlogp = coef · (logp − ref) / n_i
    assert grad_of(out.loss_sum, logp).tolist() == pytest.approx([0.05, -0.25, 0.0, 0.25, -0.075])
    assert out.metrics["kl/ref_k2"].item() == pytest.approx((0.02 + 0.5 + 0.5 + 0.045) / 4)
    k3 = [math.exp(r - p) - (r - p) - 1 for p, r in ((-1.0, -1.2), (-2.0, -1.0), (-1.5, -2.5), (-0.7, -0.4))]
    assert out.metrics["kl/ref_k3"].item() == pytest.approx(sum(k3) / 4)


def test_bound_kl_loss_takes_the_recipes_aggregation():
    kw = {
        "logp": t([-1.0, -2.0, -0.5]),
        "ref_logp": t([-1.2, -1.0, -0.5]),
        "loss_mask": torch.ones(3, dtype=torch.bool),
        "seq_ids": seq_ids_for([1, 2]),
        "num_seqs": 2,
    }
    k1, agg = KLEstimator.K1, Aggregation
    espo = registry.bind_kl_loss(k1, 0.1, agg.SEQ_MEAN_GROUP_MEAN, None)  # ESPO's own: a mean over responses
    by_response = registry.bind_kl_loss(k1, 0.1, agg.SEQ_MEAN_TOKEN_MEAN, None)
    tokens = registry.bind_kl_loss(k1, 0.1, agg.TOKEN_MEAN, None)
    assert espo(**kw).loss_sum.item() == pytest.approx(by_response(**kw).loss_sum.item())
    assert (espo(**kw).denom.item(), tokens(**kw).denom.item()) == (2.0, 3.0)
    with pytest.raises(ValueError, match="algo.kl.coef must be > 0"):
        registry.bind_kl_loss(KLEstimator.K3, 0.0, agg.TOKEN_MEAN, None)
    with pytest.raises(ValueError, match="algo.kl.estimator must be a member of KLEstimator"):
        registry.bind_kl_loss("k4", 0.1, agg.TOKEN_MEAN, None)
