"""moe_rl.algo.corrections: TIS, IcePop, rejection (MIS), OPSM, bypass/decoupled, combine."""

import math

import pytest
import torch

from moe_rl.algo.corrections import (
    combine,
    icepop,
    opsm_mask,
    rejection_mask,
    resolve_old_logp,
    seq_tis,
    token_tis,
)
from tests.unit.algo.algo_testing import all_true, seq_ids_for, t


def logs(*ratios: float):
    """old_logp, rollout_logp with old − rollout = log(ratio)."""
    return t([math.log(r) for r in ratios]), t([0.0] * len(ratios))


def test_token_tis_hand_values():
    old, roll = logs(0.5, 3.0, 1.0, 9.0)
    mask = torch.tensor([True, True, True, False])
    out = token_tis(old, roll, mask, cap=2.0)
    torch.testing.assert_close(out.weights, t([0.5, 2.0, 1.0, 0.0]))
    assert out.metrics["tis_clip_frac"].item() == pytest.approx(1 / 3)
    assert out.mask is None


def test_tis_with_infinite_cap_is_plain_importance_sampling():
    old, roll = t([-0.3, -2.0, -0.1]), t([-0.5, -1.0, -0.1])
    out = token_tis(old, roll, all_true(3), cap=math.inf)
    torch.testing.assert_close(out.weights, torch.exp(old - roll))
    seq = seq_tis(old, roll, all_true(3), seq_ids_for([2, 1]), num_seqs=2, cap=math.inf)
    torch.testing.assert_close(seq.weights, t([math.exp(-0.8)] * 2 + [1.0]))


def test_seq_tis_hand_values():
    old, roll = logs(2.0, 3.0, 0.5, 100.0)
    mask = torch.tensor([True, True, True, False])  # the masked 100× token is ignored
    out = seq_tis(old, roll, mask, seq_ids_for([2, 2]), num_seqs=2, cap=2.0)
    torch.testing.assert_close(out.weights, t([2.0, 2.0, 0.5, 0.0]))  # 6 → capped; 0.5
    assert out.metrics["tis_seq_clip_frac"].item() == pytest.approx(0.5)


def test_weights_are_detached_and_log_ratios_clamped():
    old = t([100.0, -100.0], requires_grad=True)
    out = token_tis(old, t([0.0, 0.0]), all_true(2), cap=math.inf)
    assert not out.weights.requires_grad
    torch.testing.assert_close(out.weights, t([math.exp(20), math.exp(-20)]))


def test_icepop_hand_values_keep_masked_tokens_as_zero_weights():
    old, roll = logs(0.4, 0.5, 1.0, 5.0, 6.0)
    out = icepop(old, roll, all_true(5), low=0.5, high=5.0)
    torch.testing.assert_close(out.weights, t([0.0, 0.5, 1.0, 5.0, 0.0]))
    assert out.mask is None  # masked tokens stay in the denominator
    assert out.metrics["icepop_masked_frac"].item() == pytest.approx(2 / 5)


def test_icepop_with_open_band_is_token_is():
    old, roll = t([-0.3, -7.0, 0.0]), t([-2.5, -1.0, -0.1])
    band = icepop(old, roll, all_true(3), low=0.0, high=math.inf)
    plain = token_tis(old, roll, all_true(3), cap=math.inf)
    torch.testing.assert_close(band.weights, plain.weights)


# --- rejection ---------------------------------------------------------------------------------

SEQ = seq_ids_for([2, 2])


@pytest.mark.parametrize(
    ("log_rho", "divergence", "aggregation", "low", "high", "kept_seqs"),
    [
        ([0.0, 0.0, 0.01, 0.01], "k1", "seq_mean", None, None, [True, False]),  # exp(−0.01) < 0.999
        ([0.0005, -0.0005, 0.0002, 0.0002], "k1", "seq_mean", None, None, [True, True]),
        ([0.3, -0.3, 0.3, 0.0], "k1", "seq_sum", 0.9, 1.1, [True, False]),  # exp(0) vs exp(−0.3)
        ([0.3, -0.3, 0.05, 0.0], "k1", "seq_max", 0.9, 1.1, [False, True]),  # a token exp(−0.3)
        ([0.2, 0.0, 0.1, 0.1], "k2", "seq_sum", None, 0.015, [False, True]),  # 0.02 vs 0.01
        ([0.2, 0.0, 0.1, 0.1], "k2", "seq_mean", None, 0.012, [True, True]),  # 0.01, 0.005 (sums 0.02, 0.01)
        ([0.2, 0.0, 0.1, 0.1], "k3", "seq_max", None, 0.01, [False, True]),  # k3(0.2)=0.0214
    ],
    ids=["geo-reject", "geo-keep", "k1-seq-sum", "k1-seq-max", "k2-seq-sum", "k2-seq-mean", "k3-seq-max"],
)
def test_rejection_mask_sequence_modes(log_rho, divergence, aggregation, low, high, kept_seqs):
    out = rejection_mask(
        t(log_rho), t([0.0] * 4), all_true(4), SEQ, num_seqs=2,
        divergence=divergence, aggregation=aggregation, low=low, high=high,
    )  # fmt: skip
    assert out.mask.tolist() == [kept_seqs[0]] * 2 + [kept_seqs[1]] * 2
    assert out.weights is None
    dropped = 1 - sum(kept_seqs) / 2
    assert out.metrics["rejection_masked_seq_frac"].item() == pytest.approx(dropped)


def test_rejection_token_mode_masks_tokens_only():
    out = rejection_mask(
        t([0.0, 0.5, 0.0, 0.0]), t([0.0] * 4), all_true(4), SEQ, num_seqs=2,
        divergence="k1", aggregation="token", low=0.9, high=1.1,
    )  # fmt: skip
    assert out.mask.tolist() == [True, False, True, True]
    assert out.metrics["rejection_masked_token_frac"].item() == pytest.approx(0.25)


def test_geometric_rejection_is_invariant_to_repeating_a_sequence():
    log_rho = t([0.0004, -0.0001, 0.0006])
    for band in [(0.9995, 1.0005), (0.99, 1.01), (0.9999, 1.0001)]:
        once = rejection_mask(
            log_rho, t([0.0] * 3), all_true(3), seq_ids_for([3]), num_seqs=1, low=band[0], high=band[1]
        )
        twice = rejection_mask(
            log_rho.repeat(2),
            t([0.0] * 6),
            all_true(6),
            seq_ids_for([6]),
            num_seqs=1,
            low=band[0],
            high=band[1],
        )
        assert once.mask.all() == twice.mask.all()
    # seq_sum is not length-invariant: the repeated sequence crosses the band
    kw = {"aggregation": "seq_sum", "low": 0.9985, "high": 1.0015}
    once = rejection_mask(-log_rho, t([0.0] * 3), all_true(3), seq_ids_for([3]), num_seqs=1, **kw)
    twice = rejection_mask(-log_rho.repeat(2), t([0.0] * 6), all_true(6), seq_ids_for([6]), num_seqs=1, **kw)
    assert once.mask.all() and not twice.mask.any()


def test_rejection_requires_an_upper_bound_for_k2_k3():
    with pytest.raises(ValueError, match="rejection high"):
        rejection_mask(t([0.0]), t([0.0]), all_true(1), seq_ids_for([1]), num_seqs=1, divergence="k3")
    with pytest.raises(ValueError, match="divergence must be one of"):
        rejection_mask(t([0.0]), t([0.0]), all_true(1), seq_ids_for([1]), num_seqs=1, divergence="kl")


# --- OPSM --------------------------------------------------------------------------------------


def test_opsm_drops_negative_advantage_sequences_that_drifted():
    # drift_i = mean_t(rollout_logp − logp): seq 0: 0.2; seq 1: 0.2; seq 2: 0.05
    logp = t([-1.2, -1.2, -1.0, -1.4, -0.55, -0.55], requires_grad=True)
    rollout = t([-1.0, -1.0, -0.8, -1.2, -0.5, -0.5])
    adv = t([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    out = opsm_mask(logp, rollout, adv, all_true(6), seq_ids_for([2, 2, 2]), num_seqs=3, delta=0.1)
    assert out.mask.tolist() == [False, False, True, True, True, True]
    assert out.metrics["opsm_masked_seq_frac"].item() == pytest.approx(1 / 3)
    assert not out.mask.requires_grad


def test_opsm_masks_only_negative_advantages_never_zero():
    # every response drifted by 0.5 > δ; OPSM masks A_t < 0 (DeepSeek-V3.2 Eq. 9), so A_t = 0 stays
    logp, rollout = t([-1.5] * 5), t([-1.0] * 5)
    adv = t([0.0, -1e-6, 0.0, 1.0, 0.0])  # per-token advantages (RL-ZVP) over responses [2, 3]
    out = opsm_mask(logp, rollout, adv, all_true(5), seq_ids_for([2, 3]), num_seqs=2, delta=0.1)
    assert out.mask.tolist() == [True, False, True, True, True]
    assert out.metrics["opsm_masked_token_frac"].item() == pytest.approx(1 / 5)
    assert out.metrics["opsm_masked_seq_frac"].item() == 0.0  # neither response lost every token


def test_bypass_uses_rollout_logp_and_decoupled_needs_old():
    old, roll = t([-1.0]), t([-2.0])
    assert resolve_old_logp(old, roll, mode="bypass") is roll
    assert resolve_old_logp(old, roll, mode="decoupled") is old
    with pytest.raises(ValueError, match="decoupled"):
        resolve_old_logp(None, roll, mode="decoupled")
    with pytest.raises(ValueError, match="mode must be one of"):
        resolve_old_logp(old, roll, mode="hybrid")
    # in bypass mode the engine mismatch is 0, so TIS/IcePop weights are 1
    bypass_old = resolve_old_logp(None, roll, mode="bypass")
    torch.testing.assert_close(token_tis(bypass_old, roll, all_true(1)).weights, t([1.0]))


def test_combine_multiplies_weights_and_ands_masks():
    mask = torch.tensor([True, True, False, True])
    old, roll = logs(1.5, 6.0, 1.0, 3.0)
    tis = token_tis(old, roll, mask, cap=2.0)
    ice = icepop(old, roll, mask, low=0.5, high=5.0)
    rej = rejection_mask(
        old, roll, mask, seq_ids_for([4]), num_seqs=1, aggregation="token", low=0.5, high=2.0
    )
    out = combine(mask, tis, ice, rej)
    torch.testing.assert_close(out.weights, t([1.5 * 1.5, 0.0, 0.0, 2.0 * 3.0]))
    assert out.mask.tolist() == [True, False, False, False]  # 1/6 and 1/3 outside [0.5, 2]
    assert {"tis_clip_frac", "icepop_masked_frac", "rejection_masked_token_frac"} <= set(out.metrics)
