"""moe_rl.algo.objectives.espo and entropy_groups (ESPO, arXiv 2512.00499)."""

import math

import pytest
import torch

from moe_rl.algo.objectives import entropy_groups, espo, gspo_token, ppo_clip
from tests.unit.algo.algo_testing import all_true, grad_of, seq_ids_for, t


@pytest.mark.parametrize(
    ("entropy", "rho", "k", "expected_bins"),
    [
        ([0.1, 0.9, 0.5, 0.9, 0.3], 0.2, 2, [1, 0, 1, 1, 1]),  # ceil(0.2·5)=1; tie → earlier token
        ([float(i) for i in range(10)], 0.2, 2, [1] * 8 + [0, 0]),  # ceil(2) = 2 top tokens
        ([0.3, 0.1, 0.2], 0.2, 2, [0, 1, 1]),  # ceil(0.6) = 1
        ([0.7], 0.2, 2, [0]),  # one token: the top group
        ([float(i) for i in range(10)], 0.2, 3, [2, 2, 2, 2, 1, 1, 1, 1, 0, 0]),  # cuts 2, 6
        ([0.1, 0.9, 0.5], 0.2, 1, [0, 0, 0]),  # K = 1: one group
        ([float(i) for i in range(10)], 0.7, 2, [1, 1, 1] + [0] * 7),  # 0.7·10 = 7.000000000000001 → 7
    ],
    ids=["tie", "n10", "n3-rounds-up", "one-token", "k3", "k1", "float-error"],
)
def test_entropy_groups_hand_cases(entropy, rho, k, expected_bins):
    n = len(entropy)
    got = entropy_groups(
        t(entropy), all_true(n), seq_ids_for([n]), num_seqs=1, espo_rho=rho, espo_num_groups=k
    )
    assert got.tolist() == expected_bins


def test_entropy_groups_per_response_with_masks_and_interleaving():
    seq_ids = torch.tensor([1, 0, 1, 0, 1, 0])
    entropy = t([0.9, 0.1, 0.2, 0.3, 5.0, 0.2])
    mask = torch.tensor([True, True, True, True, False, True])  # the 5.0 token does not count
    got = entropy_groups(entropy, mask, seq_ids, num_seqs=2, espo_rho=0.2, espo_num_groups=2)
    # response 0: tokens 1, 3, 5 → top = token 3 (0.3); response 1: tokens 0, 2 → top = token 0
    assert got[[1, 3, 5]].tolist() == [1, 0, 1]
    assert got[[0, 2]].tolist() == [2 + 0, 2 + 1]


def test_espo_hand_value_and_gradient():
    entropy = t([0.2, 1.0, 0.4])
    diff = [0.01, 0.05, -0.03]
    logp = t(diff, requires_grad=True)
    vocab, alpha = 100, 0.2
    out = espo(
        logp, t([0.0] * 3), t([1.0] * 3), entropy, all_true(3), seq_ids_for([3]),
        num_seqs=1, vocab_size=vocab, espo_alpha=alpha,
    )  # fmt: skip
    eps_top, eps_rest = alpha * 1.0 / math.log(vocab), alpha * 0.3 / math.log(vocab)
    s_top, s_rest = math.exp(0.05), math.exp(-0.01)
    assert s_top > 1 + eps_top and abs(s_rest - 1) < eps_rest  # top clipped, rest inside
    expected = 0.5 * (-(1 + eps_top) + -s_rest)  # mean over the two groups
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(grad_of(out.loss, logp), t([-s_rest / 4, 0.0, -s_rest / 4]))
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 3)


def test_espo_stop_gradients():
    entropy = t([0.2, 1.0, 0.4, 0.5], requires_grad=True)
    logp = t([0.001, 0.002, -0.001, 0.0], requires_grad=True)
    old = t([0.0] * 4, requires_grad=True)
    adv = t([1.0, 1.0, 0.0, 1.0])  # token 2 shares its group with 0 and 3 but has A = 0
    out = espo(
        logp, old, adv, entropy, all_true(4), seq_ids_for([4]), num_seqs=1, vocab_size=10, espo_alpha=1.0
    )
    g = grad_of(out.loss, logp)
    assert g[2] == 0 and torch.all(g[[0, 1, 3]] != 0)  # no gradient through sg(ℓ_τ)
    assert torch.autograd.grad(out.loss, [old, entropy], allow_unused=True) == (None, None)


def _random_batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    logp = (0.05 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    old = 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    entropy = 3 * torch.rand(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    return logp, old, adv, entropy, mask, seq_ids_for(lengths)


def test_espo_with_one_group_per_response_equals_gspo_token():
    lengths, vocab, alpha = [4, 1, 7], 50, 0.05
    logp, old, adv, entropy, mask, seq = _random_batch(0, lengths)
    a = espo(
        logp, old, adv, entropy, mask, seq, num_seqs=3, vocab_size=vocab, espo_alpha=alpha, espo_num_groups=1
    )
    # GSPO-token with the response's entropy-scaled clip ε_i = α·mean_i(e)/log|V|
    e_mean = torch.stack([entropy[(seq == i) & mask].mean() for i in range(3)])
    eps = (alpha * e_mean / math.log(vocab))[seq]
    b = gspo_token(logp, old, adv, mask, seq, num_seqs=3, gspo_eps_low=eps, gspo_eps_high=eps)
    assert 0 < a.metrics["clip_frac"].item() < 1  # the clip matters in this batch
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(grad_of(a.loss, logp), grad_of(b.loss, logp))


def test_espo_with_one_token_per_group_equals_token_ppo_with_entropy_scaled_clip():
    lengths, vocab, alpha = [3, 5, 2], 20, 0.1
    logp, old, adv, entropy, mask, seq = _random_batch(1, lengths)
    n = logp.numel()
    a = espo(
        logp, old, adv, entropy, mask, seq, num_seqs=3, vocab_size=vocab, espo_alpha=alpha,
        token_group_ids=torch.arange(n),
    )  # fmt: skip
    eps = alpha * entropy / math.log(vocab)
    b = ppo_clip(
        logp, old, adv, mask, seq, num_seqs=3, clip_eps_low=eps, clip_eps_high=eps, dual_clip_c=None,
        aggregation="seq_mean_token_mean",
    )  # fmt: skip
    assert 0 < a.metrics["clip_frac"].item() < 1
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(grad_of(a.loss, logp), grad_of(b.loss, logp))


def test_espo_group_mean_aggregation_by_hand():
    # response 0: groups {0} and {1, 2}; response 1: one token → one group
    entropy = t([3.0, 1.0, 2.0, 0.5])
    out = espo(
        t([0.0] * 4), t([0.0] * 4), t([1.0, 2.0, 4.0, 8.0]), entropy, all_true(4), seq_ids_for([3, 1]),
        num_seqs=2, vocab_size=10,
    )  # fmt: skip
    # ratio 1 everywhere → l_t = −A_t
    resp0 = 0.5 * (-1.0 + (-2.0 - 4.0) / 2)
    resp1 = -8.0
    assert out.loss_sum.item() == pytest.approx(resp0 + resp1)
    assert out.denom.item() == 2
    assert out.metrics["groups_per_seq"].item() == pytest.approx(1.5)


def test_espo_group_mean_weighs_each_token_by_its_correction_weight():
    # the groups of test_espo_group_mean_aggregation_by_hand: response 0 {0}, {1, 2}; response 1 {3}
    entropy, adv = t([3.0, 1.0, 2.0, 0.5]), t([1.0, 2.0, 4.0, 8.0])
    logp = t([0.0] * 4, requires_grad=True)
    weights = t([0.5, 0.0, 2.0, 1.5])  # token 1 zeroed (IcePop outside its band); mean weight 1
    out = espo(
        logp, t([0.0] * 4), adv, entropy, all_true(4), seq_ids_for([3, 1]), num_seqs=2, vocab_size=10,
        weights=weights,
    )  # fmt: skip
    # ratio 1 → l_t = −w_t·A_t; the zeroed token keeps its place in its group's size |τ| = 2
    resp0 = 0.5 * (-0.5 * 1.0 + (-0.0 * 2.0 - 2.0 * 4.0) / 2)  # = −2.25
    resp1 = -1.5 * 8.0
    assert out.loss_sum.item() == pytest.approx(resp0 + resp1)  # −14.25; unweighted −10
    assert out.denom.item() == 2
    # ∂loss/∂logp_t = −w_t·A_t / (|τ|·|G_i|) / 2 responses
    torch.testing.assert_close(grad_of(out.loss, logp), t([-0.125, 0.0, -1.0, -6.0]))


def test_espo_rejects_bad_hyperparameters():
    args = (t([0.0]), t([0.0]), t([1.0]), t([1.0]), all_true(1), seq_ids_for([1]))
    with pytest.raises(ValueError, match="espo_rho"):
        espo(*args, num_seqs=1, vocab_size=10, espo_rho=1.0)
    with pytest.raises(ValueError, match="espo_num_groups"):
        espo(*args, num_seqs=1, vocab_size=10, espo_num_groups=0)
    with pytest.raises(ValueError, match="vocab_size"):
        espo(*args, num_seqs=1, vocab_size=1)
