"""The critic's loss: PPO's clipped value loss [Schulman et al. 2017, arXiv:1707.06347; the form of
OpenAI's baselines, TRL and verl].

``l_t = ½·max((V_t − R_t)², (V_old_t + clip(V_t − V_old_t, −ε, ε) − R_t)²)`` with ``V`` the critic's
current values (with gradient), ``V_old`` its values at the π_old pass (where the returns ``R`` were
computed, `moe_rl.algo.returns`) and ``ε`` the value clip (``inf``: the plain squared error).
Aggregated as a token mean: the sum over counted tokens, and their count as the denominator, which
the trainer sums over data-parallel ranks like the policy's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.algo._ops import check_num_seqs, check_tokens, masked_mean
from moe_rl.algo.aggregate import aggregate
from moe_rl.algo.objectives import LossOutput


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    clip: float,
    global_denom: float | Tensor | None = None,
) -> LossOutput:
    """The clipped value loss (module docstring) as ``(Σ_t m_t·l_t, Σ_t m_t)``.

    Metrics (detached, over counted tokens): ``clip_frac`` (tokens where the clipped term is the
    larger), ``values_mean``, ``returns_mean``, ``abs_error`` (``mean |V − R|``)."""
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, values=values, old_values=old_values, returns=returns)
    if not isinstance(clip, int | float) or math.isnan(clip) or clip <= 0:
        raise ValueError(f"clip must be > 0 (inf: no clip), got {clip!r}")
    old_values, returns = old_values.detach().to(values.dtype), returns.detach().to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(plain_sq, clipped_sq)
    loss_sum, denom = aggregate(
        loss, loss_mask, seq_ids, num_seqs=num_seqs, mode="token_mean", global_denom=global_denom
    )
    metrics = {
        "clip_frac": masked_mean((clipped_sq > plain_sq).float(), loss_mask),
        "values_mean": masked_mean(values, loss_mask),
        "returns_mean": masked_mean(returns, loss_mask),
        "abs_error": masked_mean((values - returns).abs(), loss_mask),
    }
    return LossOutput(loss_sum, denom, metrics)
