"""Training–inference mismatch diagnostics (detached 0-d tensors, for logging).

Definitions follow verl's ``compute_offpolicy_metrics`` as described in Chris Yuhao Liu,
"Off-Policy Drift in LLM RL" (blog post, 2026), https://chrisliu298.ai/posts/off-policy-drift-in-llm-rl/
(docs/algorithms.md, "Diagnostics"), with ``log_rho_t = old_logp − rollout_logp`` clamped to ±20:

* ``kl_k1 = mean_t(rollout_logp − old_logp)``  (KL(μ ‖ π_old), samples from μ)
* ``kl_k3 = mean_t(rho − log rho − 1)``
* ``chi2_token = mean_t(rho²) − 1``; ``chi2_seq = mean_i((Π_t rho_t)²) − 1``
* ``ess_token`` / ``ess_seq``: ESS ratio ``1/mean(w̃²)`` with ``w̃ = w/mean(w)`` (in (0, 1]; the
  Kish ESS divided by the sample count) for token ratios and sequence ratios ``Π_t rho_t``
* ``ppl_ratio = mean_i(PPL_old,i / PPL_rollout,i) = mean_i exp(mean_t(rollout_logp − old_logp))``
* ``prob_pearson``: Pearson correlation of ``exp(old_logp)`` and ``exp(rollout_logp)``
* ``prob_abs_diff_max`` / ``prob_abs_diff_mean``: ``|exp(old_logp) − exp(rollout_logp)|``
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.algo._ops import (
    LOG_RATIO_CLAMP,
    check_num_seqs,
    check_tokens,
    masked_mean,
    segment_mean,
    segment_sum,
    valid_seqs,
)


def ess_sums(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """float64 ``[3]``: ``(Σw, Σw², n)`` over `mask`, the sums the ESS ratio is made of; sums of
    several parts (micro-batches, data-parallel ranks) add up to the whole's."""
    w = weights.detach().to(torch.float64)
    if mask is None:
        mask = torch.ones_like(w, dtype=torch.bool)
    w = torch.where(mask, w, 0.0)
    return torch.stack([w.sum(), (w**2).sum(), mask.sum().to(torch.float64)])


def ess_from_sums(sums: Tensor) -> Tensor:
    """The ESS ratio ``(Σw)² / (n·Σw²)`` from `ess_sums` (float64; 0 when nothing is counted)."""
    return sums[0] ** 2 / (sums[2] * sums[1]).clamp_min(1e-300)


def ess_ratio(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Normalized effective sample size ``1/mean(w̃²)``, ``w̃ = w/mean(w)`` over `mask` [Kong 1992].

    Equals ``(Σw)² / (n·Σw²)``: 1 for uniform weights, 1/n when one weight dominates; 0 when
    nothing is counted.
    """
    return ess_from_sums(ess_sums(weights, mask)).to(torch.float32)


def vcpo_lr_factor(ess: Tensor, ess_ref: float | Tensor, *, max_factor: float | None = None) -> Tensor:
    """VCPO learning-rate scale ``sqrt(ESS/ESS_ref)`` ["Stable Asynchrony: Variance-Controlled
    Off-Policy RL for LLMs", arXiv 2602.17616, Eq. 5].

    `ess` and `ess_ref` are ESS ratios (`ess_ratio`); ``ESS_ref`` is the on-policy reference
    (≈ the first on-policy step; 1 for the normalized ESS). `max_factor` optionally caps the
    scale (e.g. 1.0).
    """
    if not isinstance(ess_ref, Tensor) and not ess_ref > 0:
        raise ValueError(f"ess_ref must be > 0, got {ess_ref!r}")
    factor = torch.sqrt(ess.detach() / ess_ref)
    return factor if max_factor is None else factor.clamp_max(max_factor)


def pearson(x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """Pearson correlation of `x` and `y` over `mask` (0 when either is constant)."""
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    n = mask.sum().to(torch.float64).clamp_min(1.0)
    xc = torch.where(mask, x - torch.where(mask, x, 0.0).sum() / n, 0.0)
    yc = torch.where(mask, y - torch.where(mask, y, 0.0).sum() / n, 0.0)
    denom = torch.sqrt((xc**2).sum() * (yc**2).sum())
    return ((xc * yc).sum() / denom.clamp_min(1e-300)).to(torch.float32)


def mismatch_metrics(
    old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int
) -> dict[str, Tensor]:
    """Mismatch between π_old (trainer) and μ (engine) on the sampled tokens; see module doc."""
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, old_logp=old_logp, rollout_logp=rollout_logp)
    log_rho = (old_logp - rollout_logp).detach().to(torch.float32).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = log_rho.exp()
    seqs = valid_seqs(loss_mask, seq_ids, num_seqs)
    seq_log = segment_sum(torch.where(loss_mask, log_rho, 0.0), seq_ids, num_seqs)
    seq_log = seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_mean_log = segment_mean(log_rho, loss_mask, seq_ids, num_seqs)
    p_old, p_roll = old_logp.detach().float().exp(), rollout_logp.detach().float().exp()
    diff = (p_old - p_roll).abs()
    return {
        "kl_k1": masked_mean(-log_rho, loss_mask),
        "kl_k3": masked_mean(rho - log_rho - 1, loss_mask),
        "chi2_token": masked_mean(rho**2, loss_mask) - 1,
        "chi2_seq": masked_mean(torch.exp(2 * seq_log), seqs) - 1,
        "ess_token": ess_ratio(rho, loss_mask),
        "ess_seq": ess_ratio(seq_log.exp(), seqs),
        "ppl_ratio": masked_mean(torch.exp(-seq_mean_log), seqs),
        "prob_pearson": pearson(p_old, p_roll, loss_mask),
        "prob_abs_diff_max": torch.where(loss_mask, diff, 0.0).max() if diff.numel() else diff.new_zeros(()),
        "prob_abs_diff_mean": masked_mean(diff, loss_mask),
    }


def routing_agreement(
    topk_a_TLK: Tensor, topk_b_TLK: Tensor, token_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """Share of (token, layer) whose top-k expert *sets* match (order-insensitive) [R3, arXiv 2510.11370].

    Args:
        topk_a_TLK, topk_b_TLK: [tokens, layers, k] integer expert ids (e.g. rollout vs trainer).
        token_mask: [tokens] bool, tokens to count (default all).

    Returns ``routing_agreement`` (set equality share) and ``routing_overlap`` (mean share of
    experts of `a` also in `b`, per (token, layer); ids within a set are distinct).
    """
    if topk_a_TLK.shape != topk_b_TLK.shape or topk_a_TLK.dim() != 3:
        raise ValueError(
            f"routing traces must both be [tokens, layers, k]; got {tuple(topk_a_TLK.shape)} "
            f"and {tuple(topk_b_TLK.shape)}"
        )
    a = torch.sort(topk_a_TLK.long(), dim=-1).values
    b = torch.sort(topk_b_TLK.long(), dim=-1).values
    same = (a == b).all(-1)  # [T, L]
    overlap = (a[..., :, None] == b[..., None, :]).any(-1).float().mean(-1)  # [T, L]
    if token_mask is None:
        token_mask = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
    cells = token_mask[:, None].expand_as(same)
    return {
        "routing_agreement": masked_mean(same.float(), cells),
        "routing_overlap": masked_mean(overlap, cells),
    }
