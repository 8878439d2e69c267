"""Token-level rewards, returns and advantages: GAE with a critic, REINFORCE++, and the batch
whitening both end with.

Layout: packed per-token tensors [T] with `seq_ids` [T] as in the rest of `moe_rl.algo`, with one
requirement more, since these are recurrences along a response: **a response's tokens are
contiguous and in order** (as `moe_rl.data.packing` lays them out: response after response, token
after token), so ``seq_ids[t] == seq_ids[t+1]`` says that token t+1 follows token t. Per-response
inputs (`scores`) are [S] with ``S = num_seqs``.

* `token_rewards`: ``r_t = [t last of i]·s_i − β·kl_t``: the response's outcome score on its last
  token, the per-token KL penalty against the reference on every token (``algo.kl.in_reward``).
* `discounted_returns`: ``G_t = r_t + γ·G_{t+1}`` within a response (``G`` after its last token 0).
* `gae`: generalized advantage estimation [Schulman et al. 2016, arXiv:1506.02438]:
  ``δ_t = r_t + γ·V_{t+1} − V_t`` (``V`` after the last token 0: a response ends its episode),
  ``A_t = δ_t + γλ·A_{t+1}``, returns ``R_t = A_t + V_t`` (the λ-return, the critic's target).
  With γ = λ = 1, ``A_t = G_t − V_t``.
* `whiten_sums` / `whiten`: ``(A − mean) / sqrt(var + ε)`` over the whole batch, from sums that the
  caller adds over micro-batches and data-parallel ranks (the unbiased variance, as verl's
  ``masked_whiten``).
* `gae_estimate`, `reinforce_pp_estimate`: the estimators as the registry binds them, each returning
  `TokenReturns` (advantages before whitening, returns, token rewards). REINFORCE++ [Hu et al.
  2025, arXiv:2501.03262]: ``A_t = G_t`` whitened over the batch (its group-baseline variant starts
  from ``s_i = R_i − mean_g R``, computed by the driver over the whole batch).

Every recurrence runs as a parallel scan (`reverse_discounted_sum`: ``ceil(log2 T)`` vectorized
steps, no loop over tokens and no host sync), so nothing here calls ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo._ops import check_1d, check_num_seqs, check_tokens
from moe_rl.algo.kl import kl_penalty
from moe_rl.algo.modes import KLEstimator

WHITEN_EPS = 1e-8
"""ε under the square root of `whiten` (verl's ``masked_whiten``)."""


@dataclass
class TokenReturns:
    """What a token-level estimator gives for a micro-batch (all [T], detached)."""

    advantages: Tensor
    """Advantages before the batch whitening."""
    returns: Tensor
    """The critic's regression target (GAE's λ-returns; REINFORCE++'s discounted returns)."""
    rewards: Tensor
    """The token rewards the returns were computed from."""


def _check_rate(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def continues(seq_ids: Tensor) -> Tensor:
    """Bool [T]: token t+1 belongs to the response of token t (False at each response's last)."""
    nxt = torch.zeros_like(seq_ids, dtype=torch.bool)
    nxt[:-1] = seq_ids[1:] == seq_ids[:-1]
    return nxt


def _shift_left(x: Tensor, k: int) -> Tensor:
    """``out[t] = x[t + k]``, 0 past the end."""
    out = torch.zeros_like(x)
    if k < x.numel():
        out[: x.numel() - k] = x[k:]
    return out


def reverse_discounted_sum(x: Tensor, seq_ids: Tensor, *, coef: float) -> Tensor:
    """``y_t = x_t + coef·y_{t+1}`` within each response (``y`` after a response's last token 0).

    A parallel scan over the linear recurrence: with ``y_t = b_t + a_t·y_{t+k}`` (``a_t`` the
    product of the coefficients over the next k tokens, 0 where a response ends among them), one
    step doubles k: ``b_t += a_t·b_{t+k}``, ``a_t *= a_{t+k}``; after ``ceil(log2 T)`` steps k
    reaches past every response and ``y = b``. Only products of ``coef`` ≤ 1 are formed, so it is
    as stable as the sequential loop (it sums in another order: equal to it up to rounding)."""
    check_1d("x", x)
    check_1d("seq_ids", seq_ids, x.numel())
    _check_rate("coef", coef)
    b = x.clone()
    a = continues(seq_ids).to(x.dtype) * coef
    k = 1
    while k < x.numel():
        b = b + a * _shift_left(b, k)
        a = a * _shift_left(a, k)
        k *= 2
    return b


def token_rewards(
    scores: Tensor, seq_ids: Tensor, *, num_seqs: int, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """``r_t = [t is the last token of response i]·scores_i − kl_coef·kl_t`` (the KL term when
    `kl` is given): the outcome on the token that completes the response, the KL penalty on every
    token [REINFORCE++, Hu et al. 2025; InstructGPT's per-token KL in the reward]."""
    check_num_seqs(num_seqs)
    check_1d("scores", scores, num_seqs)
    ones = torch.ones_like(seq_ids, dtype=torch.bool)
    check_tokens(ones, seq_ids, kl=kl)
    if not isinstance(kl_coef, int | float) or kl_coef < 0:
        raise ValueError(f"kl_coef must be a number >= 0, got {kl_coef!r}")
    last = ~continues(seq_ids)
    rewards = torch.where(last, scores[seq_ids], 0.0)
    if kl is not None:
        rewards = rewards - kl_coef * kl.to(rewards.dtype)
    return rewards


def discounted_returns(rewards: Tensor, seq_ids: Tensor, *, gamma: float) -> Tensor:
    """``G_t = r_t + γ·G_{t+1}`` within each response."""
    _check_rate("gamma", gamma)
    return reverse_discounted_sum(rewards, seq_ids, coef=gamma)


def gae(
    rewards: Tensor, values: Tensor, seq_ids: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE [Schulman et al. 2016, arXiv:1506.02438] over each response: ``(advantages, returns)``
    with ``δ_t = r_t + γ·V_{t+1} − V_t``, ``A_t = Σ_k (γλ)^k δ_{t+k}``, ``R_t = A_t + V_t``; the value
    after a response's last token is 0 (its episode ends there, whether by EOS or by the length
    limit, as verl and OpenRLHF do)."""
    check_1d("rewards", rewards)
    check_1d("values", values, rewards.numel())
    _check_rate("gamma", gamma)
    _check_rate("lam", lam)
    values = values.to(rewards.dtype)
    next_values = torch.where(continues(seq_ids), _shift_left(values, 1), 0.0)
    deltas = rewards + gamma * next_values - values
    advantages = reverse_discounted_sum(deltas, seq_ids, coef=gamma * lam)
    return advantages, advantages + values


def whiten_sums(x: Tensor, loss_mask: Tensor) -> Tensor:
    """float64 [3]: ``(count, Σx, Σx²)`` over the True entries of `loss_mask`. Add them over the
    micro-batches and data-parallel ranks of a batch, then `whiten` each part with the total."""
    check_tokens(loss_mask, None, x=x)
    x = torch.where(loss_mask, x.detach().to(torch.float64), 0.0)
    return torch.stack([loss_mask.sum().to(torch.float64), x.sum(), (x * x).sum()])


def whiten(x: Tensor, loss_mask: Tensor, sums: Tensor, *, eps: float = WHITEN_EPS) -> Tensor:
    """``(x − mean) / sqrt(var + eps)`` on the True entries of `loss_mask` (0 elsewhere), with the
    mean and the unbiased variance of the whole batch from `sums` (`whiten_sums`, totalled). A
    batch of one token, or of equal values, whitens to 0."""
    check_tokens(loss_mask, None, x=x)
    check_1d("sums", sums, 3)
    count, total, squares = sums.to(torch.float64).unbind()
    mean = total / count.clamp_min(1.0)
    var = ((squares - count * mean * mean) / (count - 1.0).clamp_min(1.0)).clamp_min(0.0)
    out = (x.detach().to(torch.float64) - mean) / torch.sqrt(var + eps)
    return torch.where(loss_mask, out, 0.0).to(x.dtype)


def _kl(
    old_logp: Tensor | None, ref_logp: Tensor | None, kl_coef: float, kl_estimator: KLEstimator
) -> Tensor | None:
    """The KL penalty's per-token value at π_old (None without a penalty in the reward)."""
    if kl_coef == 0:
        return None
    if old_logp is None or ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} puts the KL in the reward: it needs old_logp and ref_logp")
    if kl_estimator == KLEstimator.K3_IS:
        raise ValueError(
            "kl_estimator 'k3_is' weighs by π_θ/π_old, which is 1 in the reward; use k1, k2, k3 or abs"
        )
    return kl_penalty(old_logp.detach(), ref_logp.detach(), estimator=kl_estimator)


def gae_estimate(
    scores: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    values: Tensor,
    gamma: float,
    lam: float,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = KLEstimator.K1,
) -> TokenReturns:
    """PPO's advantages with a critic: `token_rewards` (outcome `scores` [S] plus, with `kl_coef`
    > 0, the KL of π_old against π_ref by `kl_estimator`), then `gae` with the critic's `values`
    [T] (π_old's, at each response token's state). Returns before whitening."""
    kl = _kl(old_logp, ref_logp, kl_coef, kl_estimator)
    rewards = token_rewards(scores, seq_ids, num_seqs=num_seqs, kl=kl, kl_coef=kl_coef)
    advantages, returns = gae(rewards, values.detach(), seq_ids, gamma=gamma, lam=lam)
    return TokenReturns(advantages, returns, rewards)


def reinforce_pp_estimate(
    scores: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    gamma: float,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = KLEstimator.K1,
) -> TokenReturns:
    """REINFORCE++ [Hu et al. 2025, arXiv:2501.03262]: `token_rewards` as in `gae_estimate`, then
    the discounted returns ``G_t``, which are the advantages before the batch whitening (the
    group-baseline variant: `scores` = ``R_i − mean_g R``)."""
    kl = _kl(old_logp, ref_logp, kl_coef, kl_estimator)
    rewards = token_rewards(scores, seq_ids, num_seqs=num_seqs, kl=kl, kl_coef=kl_coef)
    returns = discounted_returns(rewards, seq_ids, gamma=gamma)
    return TokenReturns(returns, returns, rewards)
