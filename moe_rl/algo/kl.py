"""Per-token KL estimators [Schulman 2020, "Approximating KL divergence"].

With ``log_r = ref_logp − logp`` (samples from the current policy π_θ), estimating
KL(π_θ ‖ π_ref): k1 ``−log_r``, k2 ``½·log_r²``, k3 ``exp(log_r) − log_r − 1``, abs ``|log_r|``.
``k3_is`` is DeepSeek-V3.2 Eq. 7 (arXiv 2512.02556): ``(π_θ/π_old)·k3``, unbiased when the tokens
were sampled from π_old; the ratio keeps its gradient (no stop-gradient).

All return a per-token tensor [T]; aggregate it with `moe_rl.algo.aggregate`. ``log_r`` and the
IS log-ratio are clamped to ±20 before ``exp``. No stop-gradients are applied: the gradient
flows to whichever of `logp` / `ref_logp` requires it.

`kl_loss` is the penalty as a loss term, ``coef · aggregate(kl_penalty(...))``, returned as a sum
and its denominator like the objectives, so the trainer adds it to the policy loss before dividing
by the same global count.
"""

from __future__ import annotations

from torch import Tensor

from moe_rl.algo._ops import LOG_RATIO_CLAMP, masked_mean, safe_exp
from moe_rl.algo.aggregate import aggregate
from moe_rl.algo.modes import KLEstimator, values
from moe_rl.algo.objectives import LossOutput

KL_ESTIMATORS = values(KLEstimator)


def _check(logp: Tensor, ref_logp: Tensor) -> None:
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} must match logp shape {tuple(logp.shape)}")


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = ``logp − ref_logp`` (= −log_r); unbiased, high variance, can be negative."""
    _check(logp, ref_logp)
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ``½(ref_logp − logp)²``; biased, low variance, ≥ 0."""
    _check(logp, ref_logp)
    return 0.5 * (ref_logp - logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = ``exp(log_r) − log_r − 1`` with ``log_r = ref_logp − logp``; unbiased, ≥ 0."""
    _check(logp, ref_logp)
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_r.exp() - log_r - 1


def kl_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """abs = ``|logp − ref_logp|``."""
    _check(logp, ref_logp)
    return (logp - ref_logp).abs()


def kl_k3_is(logp: Tensor, ref_logp: Tensor, old_logp: Tensor) -> Tensor:
    """DeepSeek-V3.2 Eq. 7: ``exp(logp − old_logp)·k3(logp, ref_logp)``, gradient through the ratio too."""
    _check(logp, old_logp)
    return safe_exp(logp - old_logp) * kl_k3(logp, ref_logp)


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str, old_logp: Tensor | None = None) -> Tensor:
    """Dispatch on `estimator` ∈ `KL_ESTIMATORS`; ``k3_is`` needs `old_logp`."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if estimator == KLEstimator.K3_IS:
        if old_logp is None:
            raise ValueError("estimator 'k3_is' needs old_logp (the sampling policy's log-probs)")
        return kl_k3_is(logp, ref_logp, old_logp)
    return {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}[estimator](logp, ref_logp)


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    estimator: str,
    coef: float,
    aggregation: str = "token_mean",
    old_logp: Tensor | None = None,
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> LossOutput:
    """The KL penalty against a reference policy as a loss: ``coef · aggregate(kl_t)`` with
    ``kl_t = kl_penalty(logp, ref_logp, estimator, old_logp)`` (``old_logp``: the sampling policy
    of ``k3_is``), aggregated over the tokens of `loss_mask` by `moe_rl.algo.aggregate.aggregate`
    in mode `aggregation` (same keywords as the objectives).

    Metrics (detached means over counted tokens): ``kl/ref_<estimator>``, the penalty's per-token
    value, and ``kl/ref_k3``, k3 whatever the estimator (one scale to compare runs by).
    """
    if not isinstance(coef, int | float) or not coef >= 0:
        raise ValueError(f"coef must be a number >= 0, got {coef!r}")
    penalty = kl_penalty(logp, ref_logp, estimator=estimator, old_logp=old_logp)
    loss_sum, denom = aggregate(
        penalty, loss_mask, seq_ids, num_seqs=num_seqs, mode=aggregation, global_denom=global_denom,
        norm_len=norm_len, seq_num_tokens=seq_num_tokens,
    )  # fmt: skip
    metrics = {
        f"kl/ref_{estimator}": masked_mean(penalty, loss_mask),
        "kl/ref_k3": masked_mean(kl_k3(logp.detach(), ref_logp.detach()), loss_mask),
    }
    return LossOutput(coef * loss_sum, denom, metrics)
