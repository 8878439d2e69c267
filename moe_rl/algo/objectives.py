"""Policy objectives: per-token losses, then aggregation into ``LossOutput(loss_sum, denom)``.

Layout (every function): packed per-token tensors [T] — ``logp`` (π_θ, with grad),
``old_logp`` (π_old), ``advantages`` (already broadcast to tokens), ``loss_mask`` (bool, True =
counts) — plus ``seq_ids`` [T] (long, response index in ``[0, num_seqs)``; responses may have
different lengths and need not be contiguous) and the keyword ``num_seqs``.

Common keywords: ``weights`` [T] optional correction weights (TIS / IcePop; detached here and
multiplied into the per-token loss), ``aggregation`` (see `moe_rl.algo.aggregate`),
``global_denom`` (denominator summed over parallel ranks), ``norm_len`` (for
``seq_mean_token_sum_norm``), ``seq_num_tokens`` (global per-response token counts).
The trainer computes ``loss_sum / denom``; metrics are detached 0-d tensors (shares are over
counted tokens of this rank).

Clip widths may be floats or per-token tensors [T] (ESPO's entropy-scaled clip is expressed
through the same code path). All log-ratios are clamped to ±20 before ``exp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algo._ops import (
    LOG_RATIO_CLAMP,
    check_1d,
    check_num_seqs,
    check_tokens,
    masked_mean,
    safe_exp,
    segment_amax,
    segment_count,
    segment_mean,
    share,
    valid_seqs,
)
from moe_rl.algo.aggregate import aggregate, local_denominator
from moe_rl.algo.modes import Aggregation

ESPO_AGGREGATION = Aggregation.SEQ_MEAN_GROUP_MEAN
"""ESPO's own aggregation: token-mean within a group, mean over groups, mean over responses."""


@dataclass
class LossOutput:
    """A loss as a sum and its denominator (the trainer divides after summing over ranks).

    Attributes:
        loss_sum: 0-d tensor with grad.
        denom: 0-d float tensor (local count or the given global denominator).
        metrics: name → detached 0-d tensor.
    """

    loss_sum: Tensor
    denom: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)

    @property
    def loss(self) -> Tensor:
        """``loss_sum / denom`` (single-rank convenience)."""
        return self.loss_sum / self.denom


def _check_eps(name: str, eps: float | Tensor | None, upper: float = math.inf) -> None:
    if eps is None or isinstance(eps, Tensor):
        return
    if not isinstance(eps, int | float) or not 0 <= eps <= upper:
        raise ValueError(f"{name} must be a number in [0, {upper}] or a tensor, got {eps!r}")


def _bounds(like: Tensor, eps_low: float | Tensor | None, eps_high: float | Tensor | None):
    low = -math.inf if eps_low is None else 1 - eps_low
    high = math.inf if eps_high is None else 1 + eps_high
    return torch.as_tensor(low, dtype=like.dtype, device=like.device), torch.as_tensor(
        high, dtype=like.dtype, device=like.device
    )


def _clip_surrogate(ratio: Tensor, adv: Tensor, eps_low, eps_high) -> tuple[Tensor, Tensor]:
    """``−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)`` and the bool 'clip is binding' flag."""
    low, high = _bounds(ratio, eps_low, eps_high)
    surr = -adv * ratio
    surr_clipped = -adv * torch.clamp(ratio, low, high)
    return torch.maximum(surr, surr_clipped), surr_clipped > surr


def _finish(
    token_loss: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    weights: Tensor | None,
    metrics: dict[str, Tensor],
    agg: dict,
) -> LossOutput:
    if weights is not None:
        check_1d("weights", weights, token_loss.numel())
        token_loss = token_loss * weights.detach()
    loss_sum, denom = aggregate(token_loss, loss_mask, seq_ids, num_seqs=num_seqs, **agg)
    return LossOutput(loss_sum, denom, metrics)


def _agg(aggregation: str, global_denom, norm_len, seq_num_tokens) -> dict:
    return {
        "mode": aggregation,
        "global_denom": global_denom,
        "norm_len": norm_len,
        "seq_num_tokens": seq_num_tokens,
    }


def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    clip_eps_low: float | Tensor = 0.2,
    clip_eps_high: float | Tensor = 0.2,
    dual_clip_c: float | None = 3.0,
    weights: Tensor | None = None,
    aggregation: str = "token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """PPO-clip [Schulman et al. 2017] with asymmetric clip (DAPO) and dual clip [Ye et al. 2020].

    ``r = exp(logp − old_logp)``; ``l = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)``; for A < 0
    the loss is further capped at ``−c·A`` (dual clip, c = `dual_clip_c` > 1; None disables).
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, old_logp=old_logp, advantages=advantages)
    _check_eps("clip_eps_low", clip_eps_low, 1.0)
    _check_eps("clip_eps_high", clip_eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c!r}")
    log_ratio = logp - old_logp
    ratio = safe_exp(log_ratio)
    loss, clipped = _clip_surrogate(ratio, advantages, clip_eps_low, clip_eps_high)
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    metrics = {
        "clip_frac": share(clipped, loss_mask),
        "dual_clip_frac": share(dual, loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
        "approx_kl_k3": masked_mean(
            ratio - 1 - log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), loss_mask
        ),
    }
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, weights, metrics, agg)


def gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    gspo_eps_low: float | Tensor = 3e-4,
    gspo_eps_high: float | Tensor = 4e-4,
    weights: Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """GSPO, sequence level [Zheng et al., arXiv 2507.18071].

    ``s_i = exp(mean_t(logp − old_logp))`` (gradient flows through the mean to every token);
    ``l_t = −min(s_i·A_t, clip(s_i, 1−ε_low, 1+ε_high)·A_t)``, default clip (1−3e-4, 1+4e-4).
    With the default ``seq_mean_token_mean`` aggregation and a per-response advantage this is
    the paper's ``−(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)``.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, old_logp=old_logp, advantages=advantages)
    _check_eps("gspo_eps_low", gspo_eps_low, 1.0)
    _check_eps("gspo_eps_high", gspo_eps_high)
    seq_log_ratio = segment_mean(logp - old_logp, loss_mask, seq_ids, num_seqs)
    ratio = safe_exp(seq_log_ratio)[seq_ids]
    loss, clipped = _clip_surrogate(ratio, advantages, gspo_eps_low, gspo_eps_high)
    metrics = {"clip_frac": share(clipped, loss_mask), "seq_ratio_mean": masked_mean(ratio, loss_mask)}
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, weights, metrics, agg)


def _token_ratio_with_group_value(logp: Tensor, group_log_ratio: Tensor) -> Tensor:
    """``exp(sg(ℓ) + logp − sg(logp))``: value exp(ℓ), gradient exp(ℓ)·∇logp."""
    ell = group_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(ell + logp - logp.detach())


def gspo_token(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    gspo_eps_low: float | Tensor = 3e-4,
    gspo_eps_high: float | Tensor = 4e-4,
    weights: Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """GSPO-token [arXiv 2507.18071 §4.3]: per-token value ``s_t = exp(sg(ℓ_i) + logp_t − sg(logp_t))``.

    ``ℓ_i = mean_t(logp − old_logp)`` over response i; ``l_t = −min(s_t·A_t, clip(s_t)·A_t)``.
    Same value as GSPO; the gradient of token t is ``s_i·∇logp_t`` only (no cross-token terms).
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, old_logp=old_logp, advantages=advantages)
    _check_eps("gspo_eps_low", gspo_eps_low, 1.0)
    _check_eps("gspo_eps_high", gspo_eps_high)
    ell = segment_mean((logp - old_logp).detach(), loss_mask, seq_ids, num_seqs)
    ratio = _token_ratio_with_group_value(logp, ell[seq_ids])
    loss, clipped = _clip_surrogate(ratio, advantages, gspo_eps_low, gspo_eps_high)
    metrics = {"clip_frac": share(clipped, loss_mask), "seq_ratio_mean": masked_mean(ratio, loss_mask)}
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, weights, metrics, agg)


def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    clip_eps_low: float | Tensor | None = 0.2,
    clip_eps_high: float | Tensor | None = 0.2,
    weights: Tensor | None = None,
    aggregation: str = "token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """CISPO [MiniMax-M1, arXiv 2506.13585]: ``l_t = −sg(clip(r_t, 1−ε_low, 1+ε_high))·A_t·logp_t``.

    The clipped IS weight is detached, so every token keeps a gradient (``−w·A·∇logp``).
    MiniMax-M1 leaves the lower side open: pass ``clip_eps_low=None`` (None = no bound).
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, old_logp=old_logp, advantages=advantages)
    _check_eps("clip_eps_low", clip_eps_low, 1.0)
    _check_eps("clip_eps_high", clip_eps_high)
    ratio = safe_exp((logp - old_logp).detach())
    low, high = _bounds(ratio, clip_eps_low, clip_eps_high)
    is_weight = torch.clamp(ratio, low, high)
    loss = -is_weight * advantages * logp
    metrics = {
        "clip_frac": share((ratio < low) | (ratio > high), loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
    }
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, weights, metrics, agg)


def reinforce(
    logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    weights: Tensor | None = None,
    aggregation: str = "token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """REINFORCE / GPG [Williams 1992; GPG arXiv 2504.02546]: ``l_t = −A_t·logp_t`` (× external IS weights)."""
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, advantages=advantages)
    loss = -advantages * logp
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, weights, {}, agg)


def entropy_groups(
    entropy: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    espo_rho: float = 0.2,
    espo_num_groups: int = 2,
) -> Tensor:
    """ESPO entropy groups: a group index [T] in ``[0, num_seqs·K)`` (``seq·K + bin``).

    Within each response the counted tokens are ranked by entropy, highest first; ties keep
    token order (the earlier token ranks higher). Bin k holds ranks ``[C_k, C_{k+1})`` with
    ``C_0 = 0``, ``C_K = n`` and ``C_k = ceil(b_k·n)`` for the boundaries ``b_1 = ρ`` and, for
    K > 2, ``b_k = ρ + (k−1)(1−ρ)/(K−1)``: bin 0 is the top-ρ fraction, the rest is split into
    K−1 equal-width quantile bins. ``ceil`` (with a 1e-6 tolerance for float error in ρ·n)
    puts at least one token in the top group of every non-empty response; a response of one
    token is a single one-token group; empty bins are skipped. Masked tokens get group 0 of
    their response but never count (callers use `loss_mask`). K = 1 means one group per response.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, entropy=entropy)
    if not isinstance(espo_num_groups, int) or espo_num_groups < 1:
        raise ValueError(f"espo_num_groups must be an int >= 1, got {espo_num_groups!r}")
    if espo_num_groups > 1 and not 0 < espo_rho < 1:
        raise ValueError(f"espo_rho must be in (0, 1), got {espo_rho!r}")
    rank = _rank_within_response(entropy.detach(), loss_mask, seq_ids, num_seqs)
    bins = _quantile_bins(rank, loss_mask, seq_ids, num_seqs, espo_rho, espo_num_groups)
    return seq_ids * espo_num_groups + bins


def _rank_within_response(entropy: Tensor, loss_mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Rank (0 = highest entropy) of each counted token within its response, ties by position."""
    key = torch.where(loss_mask, seq_ids, num_seqs)  # masked tokens sort last
    by_entropy = torch.argsort(entropy, descending=True, stable=True)
    order = by_entropy[torch.argsort(key[by_entropy], stable=True)]
    counts = segment_count(loss_mask, seq_ids, num_seqs, torch.long)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [S+1], index S = masked block
    sorted_key = key[order]
    rank_sorted = torch.arange(order.numel(), device=order.device) - starts[sorted_key]
    return torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)


def _quantile_bins(rank: Tensor, loss_mask, seq_ids, num_seqs: int, rho: float, num_groups: int) -> Tensor:
    if num_groups == 1:
        return torch.zeros_like(rank)
    bounds = [rho + (k - 1) * (1 - rho) / (num_groups - 1) for k in range(1, num_groups)]
    n = segment_count(loss_mask, seq_ids, num_seqs, torch.float64)[seq_ids]
    b = torch.tensor(bounds, dtype=torch.float64, device=rank.device)
    cuts = torch.ceil(b[None, :] * n[:, None] - 1e-6)  # [T, K-1]
    return (rank[:, None].to(torch.float64) >= cuts).sum(-1).where(loss_mask, 0)


def espo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    entropy: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    vocab_size: int,
    espo_rho: float = 0.2,
    espo_num_groups: int = 2,
    espo_alpha: float = 0.02,
    token_group_ids: Tensor | None = None,
    weights: Tensor | None = None,
    aggregation: str = ESPO_AGGREGATION,
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """ESPO, Entropy importance Sampling Policy Optimization [arXiv 2512.00499; CompassMax-V3 2512.07710].

    1. ``entropy`` e_t: full-vocabulary entropy of π_old (`token_entropy` of the old logits).
    2. Entropy groups τ per response (`entropy_groups`: top-ρ fraction vs the rest, K bins).
    3. ``ℓ_τ = mean_{t∈τ}(logp − old_logp)``; ``s_t = exp(sg(ℓ_τ) + logp_t − sg(logp_t))``
       (GSPO-token form, not the paper's printed Eq. 9 denominator).
    4. ``ε_τ = α·mean_{t∈τ}(e_t)/log|V|`` (symmetric, α = 0.02, |V| = `vocab_size`).
    5. ``l_t = −min(s_t·A_t, clip(s_t, 1−ε_τ, 1+ε_τ)·A_t)``; aggregated (default
       ``seq_mean_group_mean``) as token-mean within a group, mean over the response's
       non-empty groups, mean over responses (denominator = counted responses). No KL term.

    Choices the paper leaves open (ours): ties in entropy keep token order; ρ·n is rounded up
    (every non-empty response has ≥ 1 top-entropy token); a one-token group is an ordinary
    group (its ratio is the token ratio); only counted tokens (`loss_mask`) enter ranks, means
    and sizes; no dual clip; ℓ_τ is clamped to ±20. `token_group_ids` [T] (long, in ``[0, T)``, a
    group never spanning two responses) overrides step 2, e.g. to test the reductions:
    one group per response = GSPO-token; one token per group = token PPO with clip ε_t.
    Any standard `aggregation` mode may replace the group mean.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, old_logp=old_logp, advantages=advantages, entropy=entropy)
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if not espo_alpha >= 0:
        raise ValueError(f"espo_alpha must be >= 0, got {espo_alpha!r}")
    group_ids = token_group_ids
    if group_ids is None:
        group_ids = entropy_groups(
            entropy, loss_mask, seq_ids, num_seqs=num_seqs, espo_rho=espo_rho, espo_num_groups=espo_num_groups
        )
        num_groups = num_seqs * espo_num_groups
    else:
        check_1d("token_group_ids", group_ids, logp.numel())
        num_groups = logp.numel()
    ell = segment_mean((logp - old_logp).detach(), loss_mask, group_ids, num_groups)
    e_mean = segment_mean(entropy.detach().to(ell.dtype), loss_mask, group_ids, num_groups)
    eps = (espo_alpha * e_mean / math.log(vocab_size))[group_ids]
    ratio = _token_ratio_with_group_value(logp, ell[group_ids])
    loss, clipped = _clip_surrogate(ratio, advantages, eps, eps)
    metrics = {
        "clip_frac": share(clipped, loss_mask),
        "clip_eps_mean": masked_mean(eps, loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
    }
    if aggregation != ESPO_AGGREGATION:
        agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
        return _finish(loss, loss_mask, seq_ids, num_seqs, weights, metrics, agg)
    return _group_mean_aggregate(
        loss, loss_mask, seq_ids, num_seqs, group_ids, num_groups, weights, global_denom, metrics
    )


def _group_mean_aggregate(
    loss, loss_mask, seq_ids, num_seqs, group_ids, num_groups, weights, global_denom, metrics
) -> LossOutput:
    """``Σ_i (1/|G_i|) Σ_τ (1/|τ|) Σ_{t∈τ} l_t`` and the counted-response denominator."""
    if weights is not None:
        check_1d("weights", weights, loss.numel())
        loss = loss * weights.detach()
    group_size = segment_count(loss_mask, group_ids, num_groups, loss.dtype)
    group_seq = segment_amax(seq_ids, loss_mask, group_ids, num_groups, -1)
    nonempty = group_size > 0
    groups_per_seq = segment_count(nonempty, group_seq.clamp_min(0), num_seqs, loss.dtype)
    coeff = 1.0 / (group_size[group_ids] * groups_per_seq[seq_ids]).clamp_min(1.0)
    loss_sum = torch.where(loss_mask, loss * coeff, 0.0).sum()
    if global_denom is None:
        denom = local_denominator(loss_mask, seq_ids, num_seqs=num_seqs, mode="seq_mean_token_sum")
    else:
        denom = torch.as_tensor(global_denom, dtype=torch.float32, device=loss.device).reshape(())
    metrics["groups_per_seq"] = (
        groups_per_seq.sum() / valid_seqs(loss_mask, seq_ids, num_seqs).sum().clamp_min(1)
    ).detach()
    return LossOutput(loss_sum, denom, metrics)


def dgo_weights(rewards: Tensor, group_ids: Tensor, *, dgo_beta: float = 0.1) -> Tensor:
    """DGO sample weights: ``w = exp(r/β) / mean_n exp(r_n/β)`` ["Scaling Online RLVR Done Right with
    Decoupled Generation & Optimization", ICLR 2026 blog post,
    https://iclr-blogposts.github.io/2026/blog/2026/scaling-rlvr/].

    The mean runs over the N samples of the same prompt (`group_ids`); computed as a shifted
    softmax (``exp((r − max_g)/β)``) so large r/β does not overflow. Detached: the weights
    depend only on the sampling policy's rewards, so multi-epoch reuse is valid.
    """
    check_1d("rewards", rewards)
    check_1d("group_ids", group_ids, rewards.numel())
    if not dgo_beta > 0:
        raise ValueError(f"dgo_beta must be > 0, got {dgo_beta!r}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    rewards = rewards.detach().to(torch.float32)
    ones = torch.ones_like(rewards, dtype=torch.bool)
    peak = segment_amax(rewards, ones, inverse, uniq.numel(), -torch.inf)
    scaled = torch.exp((rewards - peak[inverse]) / dgo_beta)
    return scaled / segment_mean(scaled, ones, inverse, uniq.numel())[inverse]


def sft_weights(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """SFT's sample weights: 1 for every sample (maximum likelihood; the rewards are not read)."""
    check_1d("rewards", rewards)
    check_1d("group_ids", group_ids, rewards.numel())
    return torch.ones_like(rewards, dtype=torch.float32)


def sft(
    logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    aggregation: str = "seq_mean_token_sum",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """SFT: `weighted_sft` with every weight 1, the negative log-likelihood of the responses."""
    return weighted_sft(
        logp, loss_mask, seq_ids, num_seqs=num_seqs, seq_weights=logp.new_ones(num_seqs),
        aggregation=aggregation, global_denom=global_denom, norm_len=norm_len, seq_num_tokens=seq_num_tokens,
    )  # fmt: skip


def weighted_sft(
    logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    seq_weights: Tensor,
    aggregation: str = "seq_mean_token_sum",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """Weighted SFT: ``l_t = −w_i·logp_t``; with ``seq_mean_token_sum`` = ``mean_i(−w_i·log π(y_i|x))``."""
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp)
    check_1d("seq_weights", seq_weights, num_seqs)
    loss = -seq_weights.detach().to(logp.dtype)[seq_ids] * logp
    agg = _agg(aggregation, global_denom, norm_len, seq_num_tokens)
    return _finish(loss, loss_mask, seq_ids, num_seqs, None, {}, agg)


def dgo(
    logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    rewards: Tensor,
    group_ids: Tensor,
    dgo_beta: float = 0.1,
    aggregation: str = "seq_mean_token_sum",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """DGO offline weighted SFT: `weighted_sft` with `dgo_weights` (β = 0.1) of the [S] `rewards`."""
    w = dgo_weights(rewards, group_ids, dgo_beta=dgo_beta)
    out = weighted_sft(
        logp,
        loss_mask,
        seq_ids,
        num_seqs=num_seqs,
        seq_weights=w,
        aggregation=aggregation,
        global_denom=global_denom,
        norm_len=norm_len,
        seq_num_tokens=seq_num_tokens,
    )
    out.metrics["dgo_weight_max"] = w.max() if w.numel() else w.new_zeros(())
    return out
