"""Loss aggregation: per-token losses → (sum, denominator).

The trainer computes ``loss = Σ_ranks sum / Σ_ranks denominator``: each rank returns its local
`sum`, the denominator is either this rank's count (`local_denominator`) or a `global_denom`
the trainer has already summed over data- and context-parallel ranks. Then the gradient does
not depend on the parallel layout (tests/distributed/test_algo_dp.py proves it for DP=2).

Modes (``l_t`` per-token loss, ``m_t`` = loss_mask, ``n_i = Σ_t m_t`` tokens of response i,
``S'`` = responses with at least one counted token):

* ``token_mean`` (DAPO):           sum = Σ_t m_t l_t,            denom = Σ_t m_t
* ``seq_mean_token_sum`` (Dr.GRPO): sum = Σ_t m_t l_t,            denom = |S'|
* ``seq_mean_token_mean`` (GRPO):  sum = Σ_i (1/n_i) Σ_t m_t l_t, denom = |S'|
* ``seq_mean_token_sum_norm``:     sum = Σ_t m_t l_t / L,         denom = |S'|
  (L = `norm_len`, a constant such as the maximum response length; Dr.GRPO's constant normalizer).

Responses whose tokens are all masked (e.g. dropped by OPSM or rejection) are not counted in
the sequence-mean denominators (as verl's ``agg_loss``). Each response must be whole on a rank
for ``seq_mean_token_mean`` unless `seq_num_tokens` gives the global per-response count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.algo._ops import check_num_seqs, check_tokens, segment_count, valid_seqs
from moe_rl.algo.modes import AGGREGATIONS, Aggregation


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def local_denominator(loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int, mode: str) -> Tensor:
    """This rank's denominator for `mode` (float32 0-d): token count or counted responses."""
    _check_mode(mode)
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids)
    if mode == Aggregation.TOKEN_MEAN:
        return loss_mask.sum().to(torch.float32)
    return valid_seqs(loss_mask, seq_ids, num_seqs).sum().to(torch.float32)


def _as_denominator(global_denom: float | Tensor, like: Tensor) -> Tensor:
    if isinstance(global_denom, Tensor):
        return global_denom.to(like.device, torch.float32).reshape(())
    if not isinstance(global_denom, int | float) or global_denom <= 0:
        raise ValueError(f"global_denom must be a positive number or a tensor, got {global_denom!r}")
    return torch.tensor(float(global_denom), device=like.device)


def aggregate(
    token_loss: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    mode: str = "token_mean",
    global_denom: float | Tensor | None = None,
    norm_len: float | None = None,
    seq_num_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reduce a per-token loss [T] to ``(loss_sum, denom)`` under aggregation `mode`.

    Args:
        token_loss: [T] per-token loss (masked-out entries may hold anything finite or not).
        loss_mask: [T] bool, True = counts.
        seq_ids: [T] long response index in ``[0, num_seqs)``.
        mode: one of `AGGREGATIONS`.
        global_denom: denominator summed over parallel ranks; None = `local_denominator`.
        norm_len: the constant L of ``seq_mean_token_sum_norm`` (required there, > 0).
        seq_num_tokens: [S] counted tokens per response, global over context-parallel ranks
            (``seq_mean_token_mean`` only); None = count on this rank.
    """
    _check_mode(mode)
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, token_loss=token_loss)
    masked = torch.where(loss_mask, token_loss, 0.0)
    if mode == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        if seq_num_tokens is None:
            seq_num_tokens = segment_count(loss_mask, seq_ids, num_seqs, masked.dtype)
        masked = masked / seq_num_tokens.to(masked.dtype).clamp_min(1.0)[seq_ids]
    loss_sum = masked.sum()
    if mode == Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        if norm_len is None or not norm_len > 0:
            raise ValueError(f"norm_len must be > 0 for seq_mean_token_sum_norm, got {norm_len!r}")
        loss_sum = loss_sum / norm_len
    if global_denom is None:
        denom = local_denominator(loss_mask, seq_ids, num_seqs=num_seqs, mode=mode)
    else:
        denom = _as_denominator(global_denom, loss_sum)
    return loss_sum, denom


def token_mean(
    token_loss: Tensor, loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int, **kw
) -> tuple[Tensor, Tensor]:
    """DAPO token-mean: ``(Σ_t m_t l_t, Σ_t m_t)``; see `aggregate`."""
    return aggregate(token_loss, loss_mask, seq_ids, num_seqs=num_seqs, mode="token_mean", **kw)


def seq_mean_token_sum(
    token_loss: Tensor, loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int, **kw
) -> tuple[Tensor, Tensor]:
    """Dr.GRPO seq-mean-token-sum: ``(Σ_t m_t l_t, |S'|)``; see `aggregate`."""
    return aggregate(token_loss, loss_mask, seq_ids, num_seqs=num_seqs, mode="seq_mean_token_sum", **kw)


def seq_mean_token_mean(
    token_loss: Tensor, loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int, **kw
) -> tuple[Tensor, Tensor]:
    """GRPO seq-mean-token-mean: ``(Σ_i mean_t l_t, |S'|)``; see `aggregate`."""
    return aggregate(token_loss, loss_mask, seq_ids, num_seqs=num_seqs, mode="seq_mean_token_mean", **kw)


def seq_mean_token_sum_norm(
    token_loss: Tensor, loss_mask: Tensor, seq_ids: Tensor, *, num_seqs: int, norm_len: float, **kw
) -> tuple[Tensor, Tensor]:
    """Seq-mean of token sums divided by the constant `norm_len`: ``(Σ_t m_t l_t / L, |S'|)``."""
    return aggregate(
        token_loss,
        loss_mask,
        seq_ids,
        num_seqs=num_seqs,
        mode="seq_mean_token_sum_norm",
        norm_len=norm_len,
        **kw,
    )
