"""moe_rl.algo.diagnostics: mismatch metrics, ESS, routing agreement, VCPO factor."""

import math

import pytest
import torch

from moe_rl.algo.diagnostics import ess_ratio, mismatch_metrics, pearson, routing_agreement, vcpo_lr_factor
from tests.unit.algo.algo_testing import all_true, seq_ids_for, t


def test_mismatch_metrics_hand_values():
    # rho = old/rollout per token: [2, 0.5 | 1]; third token masked out
    old = t([math.log(0.4), math.log(0.1), math.log(0.3), 0.0])
    roll = t([math.log(0.2), math.log(0.2), math.log(0.3), -5.0])
    mask = torch.tensor([True, True, True, False])
    m = mismatch_metrics(old, roll, mask, seq_ids_for([2, 2]), num_seqs=2)
    log2 = math.log(2)
    assert m["kl_k1"].item() == pytest.approx((-log2 + log2 + 0) / 3)
    assert m["kl_k3"].item() == pytest.approx(((2 - log2 - 1) + (0.5 + log2 - 1)) / 3)
    assert m["chi2_token"].item() == pytest.approx((4 + 0.25 + 1) / 3 - 1)
    assert m["chi2_seq"].item() == pytest.approx((1 + 1) / 2 - 1)  # products 1 and 1
    assert m["ess_token"].item() == pytest.approx(3.5**2 / (3 * 5.25))
    assert m["ess_seq"].item() == pytest.approx(1.0)
    assert m["ppl_ratio"].item() == pytest.approx(1.0)  # per response exp(−mean log rho) = 1, 1
    assert m["prob_abs_diff_max"].item() == pytest.approx(0.2)
    assert m["prob_abs_diff_mean"].item() == pytest.approx((0.2 + 0.1 + 0.0) / 3)
    assert -1 <= m["prob_pearson"].item() <= 1


@pytest.mark.parametrize(
    ("weights", "expected"),
    [([1.0, 1.0, 1.0, 1.0], 1.0), ([4.0, 0.0, 0.0, 0.0], 0.25), ([1.0, 3.0], 16 / 20)],
    ids=["uniform", "one-dominates", "1-3"],
)
def test_ess_ratio_hand_values(weights, expected):
    assert ess_ratio(t(weights)).item() == pytest.approx(expected)


def test_pearson_linear_and_anti_linear():
    x = t([0.1, 0.5, 0.9, 0.3])
    assert pearson(x, 2 * x + 1, all_true(4)).item() == pytest.approx(1.0)
    assert pearson(x, -x, all_true(4)).item() == pytest.approx(-1.0)


def test_routing_agreement_is_order_insensitive_set_equality():
    a = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]])  # [tokens=2, layers=2, k=2]
    b = torch.tensor([[[2, 1], [3, 5]], [[5, 6], [0, 7]]])
    m = routing_agreement(a, b)
    assert m["routing_agreement"].item() == pytest.approx(3 / 4)
    assert m["routing_overlap"].item() == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    only_second = routing_agreement(a, b, token_mask=torch.tensor([False, True]))
    assert only_second["routing_agreement"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="tokens, layers, k"):
        routing_agreement(a, b[:, :1])


def test_routing_agreement_accepts_compact_uint8_traces():
    a = torch.tensor([[[200, 3]]], dtype=torch.uint8)
    assert routing_agreement(a, a.flip(-1))["routing_agreement"].item() == 1.0


def test_vcpo_lr_factor():
    assert vcpo_lr_factor(torch.tensor(0.25), 1.0).item() == pytest.approx(0.5)
    assert vcpo_lr_factor(torch.tensor(0.9), 0.5, max_factor=1.0).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ess_ref"):
        vcpo_lr_factor(torch.tensor(0.5), 0.0)
