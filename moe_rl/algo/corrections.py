"""Off-policy corrections: weights and masks that compose with any objective.

``log_rho_t = old_logp − rollout_logp`` (engine mismatch at the same weights), clamped to ±20
before ``exp``. Every function returns a `CorrectionOutput`:

* ``weights`` [T] float, detached, 0 where the input `loss_mask` is False — multiply them into
  the per-token loss (objectives' ``weights=``). Tokens a weight zeroes (IcePop) stay in the
  aggregation denominator, as in verl's ``token_is`` band mode.
* ``mask`` [T] bool, always a subset of the input `loss_mask` (a mask never re-enables a
  token) — AND it into the loss mask; masked tokens leave the denominator.
* ``metrics``: detached 0-d tensors (shares over counted tokens / responses of this batch).

Bypass vs decoupled (`resolve_old_logp`): bypass sets ``old_logp := rollout_logp`` (the PPO
ratio then absorbs the engine mismatch and TIS/IcePop weights are 1; a trainer that needs no
π_old for anything else could skip that pass); decoupled keeps the three policies separate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algo._ops import (
    LOG_RATIO_CLAMP,
    check_num_seqs,
    check_tokens,
    masked_mean,
    segment_amin,
    segment_mean,
    segment_sum,
    share,
    valid_seqs,
)
from moe_rl.algo.modes import Divergence, PolicyMode, RejectionAggregation, values

REJECTION_DIVERGENCES = values(Divergence)
REJECTION_AGGREGATIONS = values(RejectionAggregation)
CORRECTION_MODES = values(PolicyMode)
GEOMETRIC_BAND = (0.999, 1.001)
"""Default band for k1 divergences (verl's geometric rejection on ``exp(mean k1)``)."""


@dataclass
class CorrectionOutput:
    """Weights (multiply into the loss) and/or a mask (AND into loss_mask), plus metrics."""

    weights: Tensor | None = None
    mask: Tensor | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)


def log_importance_ratio(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """``clamp(old_logp − rollout_logp, −20, 20)``, detached."""
    return (old_logp - rollout_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def resolve_old_logp(old_logp: Tensor | None, rollout_logp: Tensor, *, mode: str = "decoupled") -> Tensor:
    """The π_old log-probs to use: ``rollout_logp`` in bypass mode, `old_logp` when decoupled."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if mode == PolicyMode.BYPASS:
        return rollout_logp
    if old_logp is None:
        raise ValueError("old_logp is None but mode='decoupled' needs the recomputed π_old log-probs")
    return old_logp


def _check_cap(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0 (math.inf = no cap), got {value!r}")


def token_tis(
    old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, *, cap: float = 2.0
) -> CorrectionOutput:
    """Token truncated IS [FlashRL / Yao et al. 2025]: ``w_t = min(exp(log_rho_t), C)``, C = 2."""
    check_tokens(loss_mask, old_logp=old_logp, rollout_logp=rollout_logp)
    _check_cap("cap", cap)
    rho = torch.exp(log_importance_ratio(old_logp, rollout_logp))
    weights = torch.where(loss_mask, rho.clamp_max(cap), 0.0)
    metrics = {
        "tis_clip_frac": share(rho > cap, loss_mask),
        "tis_weight_mean": masked_mean(weights, loss_mask),
    }
    return CorrectionOutput(weights=weights, metrics=metrics)


def seq_tis(
    old_logp: Tensor,
    rollout_logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    cap: float = 2.0,
) -> CorrectionOutput:
    """Sequence truncated IS: ``w_i = min(exp(Σ_t log_rho_t), C)`` broadcast to the response's tokens.

    Per-token log-ratios are clamped to ±20, and so is their sum before ``exp``.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, old_logp=old_logp, rollout_logp=rollout_logp)
    _check_cap("cap", cap)
    log_rho = torch.where(loss_mask, log_importance_ratio(old_logp, rollout_logp), 0.0)
    seq_log = segment_sum(log_rho, seq_ids, num_seqs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_rho = torch.exp(seq_log)
    weights = torch.where(loss_mask, seq_rho.clamp_max(cap)[seq_ids], 0.0)
    seqs = valid_seqs(loss_mask, seq_ids, num_seqs)
    metrics = {
        "tis_seq_clip_frac": share(seq_rho > cap, seqs),
        "tis_weight_mean": masked_mean(weights, loss_mask),
    }
    return CorrectionOutput(weights=weights, metrics=metrics)


def icepop(
    old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, *, low: float = 0.5, high: float = 5.0
) -> CorrectionOutput:
    """IcePop [Ring-1T, arXiv 2510.18855 §2.3.2]: ``w_t = M(k_t)``, ``M(k) = k`` if α ≤ k ≤ β else 0.

    ``k_t = exp(log_rho_t)``, α = `low` = 0.5, β = `high` = 5. Returned as weights: a masked
    token contributes 0 to the loss sum but stays in the token-mean denominator (as verl). With
    band (0, ∞) this is plain token IS.
    """
    check_tokens(loss_mask, old_logp=old_logp, rollout_logp=rollout_logp)
    if not (isinstance(low, int | float) and isinstance(high, int | float) and 0 <= low <= high):
        raise ValueError(f"icepop band must satisfy 0 <= low <= high, got low={low!r}, high={high!r}")
    k = torch.exp(log_importance_ratio(old_logp, rollout_logp))
    inside = (k >= low) & (k <= high)
    weights = torch.where(loss_mask & inside, k, 0.0)
    return CorrectionOutput(weights=weights, metrics={"icepop_masked_frac": share(~inside, loss_mask)})


def _divergence(log_rho: Tensor, divergence: str) -> Tensor:
    if divergence == Divergence.K1:
        return -log_rho
    if divergence == Divergence.K2:
        return 0.5 * log_rho**2
    return torch.exp(log_rho) - log_rho - 1


def _rejection_band(divergence: str, low: float | None, high: float | None) -> tuple[float, float]:
    if divergence == Divergence.K1 and low is None and high is None:
        return GEOMETRIC_BAND
    if divergence != Divergence.K1 and high is None:
        raise ValueError(f"rejection high must be given for divergence {divergence!r} (an upper bound on it)")
    band = (-math.inf if low is None else low, math.inf if high is None else high)
    if not band[0] <= band[1]:
        raise ValueError(f"rejection band must satisfy low <= high, got low={low!r}, high={high!r}")
    return band


def rejection_mask(
    old_logp: Tensor,
    rollout_logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    divergence: str = "k1",
    aggregation: str = "seq_mean",
    low: float | None = None,
    high: float | None = None,
) -> CorrectionOutput:
    """Masked IS / rejection sampling (verl rollout correction; Liu & Li 2025, "RL collapse").

    Token divergence ``d_t``: k1 ``−log_rho``, k2 ``½log_rho²``, k3 ``rho − log_rho − 1``.
    Statistic: token ``d_t``; seq_sum ``Σ_t d_t``; seq_mean ``mean_t d_t`` (geometric,
    length-invariant); for k1 the statistic is compared in ratio space, ``exp(stat)``
    (default band 0.999..1.001 on ``exp(mean k1)``); k2/k3 compare ``stat`` itself (`high`
    required, `low` optional). seq_max keeps a response iff every token passes the token
    test (for k2/k3: ``max_t d_t ≤ high``). Tokens of rejected responses (or rejected tokens,
    for ``token``) get mask False.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, old_logp=old_logp, rollout_logp=rollout_logp)
    if divergence not in REJECTION_DIVERGENCES:
        raise ValueError(f"divergence must be one of {REJECTION_DIVERGENCES}, got {divergence!r}")
    if aggregation not in REJECTION_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {REJECTION_AGGREGATIONS}, got {aggregation!r}")
    lo, hi = _rejection_band(divergence, low, high)
    d = _divergence(log_importance_ratio(old_logp, rollout_logp), divergence)

    def inside(stat: Tensor) -> Tensor:
        value = (
            torch.exp(stat.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) if divergence == Divergence.K1 else stat
        )
        return (value >= lo) & (value <= hi)

    if aggregation == RejectionAggregation.TOKEN:
        keep = inside(d)
    elif aggregation == RejectionAggregation.SEQ_MAX:
        keep = segment_amin(inside(d).float(), loss_mask, seq_ids, num_seqs, 1.0)[seq_ids] > 0
    elif aggregation == RejectionAggregation.SEQ_MEAN:
        keep = inside(segment_mean(d, loss_mask, seq_ids, num_seqs))[seq_ids]
    else:
        keep = inside(segment_sum(torch.where(loss_mask, d, 0.0), seq_ids, num_seqs))[seq_ids]
    mask = loss_mask & keep
    return CorrectionOutput(mask=mask, metrics=_mask_metrics("rejection", mask, loss_mask, seq_ids, num_seqs))


def _mask_metrics(
    prefix: str, mask: Tensor, loss_mask: Tensor, seq_ids: Tensor, num_seqs: int
) -> dict[str, Tensor]:
    before = valid_seqs(loss_mask, seq_ids, num_seqs)
    after = valid_seqs(mask, seq_ids, num_seqs)
    return {
        f"{prefix}_masked_token_frac": share(~mask, loss_mask),
        f"{prefix}_masked_seq_frac": share(~after, before),
    }


def opsm_mask(
    logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    delta: float,
) -> CorrectionOutput:
    """Off-policy sequence masking [DeepSeek-V3.2, arXiv 2512.02556, Eq. 8–9].

    Mask token t of response i when ``A_t < 0`` and ``mean_t(rollout_logp − logp) > δ`` over
    the response's counted tokens — with per-response advantages this drops the whole response.
    `logp` is the current policy (detached here; recompute every mini-batch). δ has no
    published value.
    """
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, logp=logp, rollout_logp=rollout_logp, advantages=advantages)
    if not isinstance(delta, int | float) or math.isnan(delta):
        raise ValueError(f"delta must be a number, got {delta!r}")
    drift = segment_mean((rollout_logp - logp).detach(), loss_mask, seq_ids, num_seqs)
    drop = (advantages < 0) & (drift > delta)[seq_ids]
    mask = loss_mask & ~drop
    metrics = _mask_metrics("opsm", mask, loss_mask, seq_ids, num_seqs)
    metrics["opsm_drift_mean"] = masked_mean(drift, valid_seqs(loss_mask, seq_ids, num_seqs))
    return CorrectionOutput(mask=mask, metrics=metrics)


def combine(loss_mask: Tensor, *outputs: CorrectionOutput) -> CorrectionOutput:
    """Compose corrections: product of the weights, AND of the masks (with `loss_mask`), merged metrics."""
    weights, mask, metrics = None, loss_mask, {}
    for out in outputs:
        if out.weights is not None:
            weights = out.weights if weights is None else weights * out.weights
        if out.mask is not None:
            mask = mask & out.mask
        metrics.update(out.metrics)
    return CorrectionOutput(weights=weights, mask=mask, metrics=metrics)
