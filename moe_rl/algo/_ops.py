"""Segment reductions and input checks shared by the `moe_rl.algo` modules (private).

Layout used everywhere in `moe_rl.algo`: packed per-token tensors of shape [T] (the tokens of
many responses, concatenated) plus `seq_ids` [T] (long, values in ``[0, num_seqs)``) naming the
response each token belongs to. Tokens of one response need not be contiguous. `loss_mask` [T]
is bool, True = the token counts. Segment ops are sync-free (``index_add`` / ``scatter_reduce``
with a known segment count), so nothing here calls ``.item()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ±20 before ``exp`` (e^20 ≈ 4.85e8), as in verl's SAFETY_BOUND."""


def safe_exp(log_x: Tensor) -> Tensor:
    """``exp(clamp(log_x, -20, 20))``."""
    return torch.exp(log_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def check_1d(name: str, x: Tensor, num: int | None = None) -> None:
    """Raise ValueError unless `x` is a 1-D tensor (of length `num` when given)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (packed tokens), got shape {tuple(x.shape)}")
    if num is not None and x.numel() != num:
        raise ValueError(f"{name} must have {num} elements, got {x.numel()}")


def check_tokens(loss_mask: Tensor, seq_ids: Tensor | None = None, **tensors: Tensor | None) -> int:
    """Check the packed layout: bool 1-D `loss_mask`, long `seq_ids` and same-length tensors."""
    check_1d("loss_mask", loss_mask)
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be torch.bool (True = counts), got {loss_mask.dtype}")
    num_tokens = loss_mask.numel()
    if seq_ids is not None:
        check_1d("seq_ids", seq_ids, num_tokens)
        if seq_ids.dtype != torch.long:
            raise ValueError(f"seq_ids must be torch.long, got {seq_ids.dtype}")
    for name, x in tensors.items():
        if x is not None:
            check_1d(name, x, num_tokens)
    return num_tokens


def check_num_seqs(num_seqs: int) -> None:
    if not isinstance(num_seqs, int) or isinstance(num_seqs, bool) or num_seqs < 0:
        raise ValueError(f"num_seqs must be a non-negative int, got {num_seqs!r}")


def segment_sum(values: Tensor, seg_ids: Tensor, num_segments: int) -> Tensor:
    """Differentiable ``out[s] = Σ_{t: seg_ids[t]=s} values[t]``."""
    return values.new_zeros(num_segments).index_add(0, seg_ids, values)


def segment_count(mask: Tensor, seg_ids: Tensor, num_segments: int, dtype: torch.dtype) -> Tensor:
    """Number of True entries of `mask` per segment, as `dtype`."""
    return torch.zeros(num_segments, dtype=dtype, device=mask.device).index_add(0, seg_ids, mask.to(dtype))


def segment_mean(values: Tensor, mask: Tensor, seg_ids: Tensor, num_segments: int) -> Tensor:
    """Mean of `values` over the True entries of `mask` per segment; 0 for an empty segment."""
    total = segment_sum(torch.where(mask, values, 0.0), seg_ids, num_segments)
    count = segment_count(mask, seg_ids, num_segments, total.dtype)
    return total / count.clamp_min(1.0)


def segment_amax(values: Tensor, mask: Tensor, seg_ids: Tensor, num_segments: int, fill: float) -> Tensor:
    """Max of `values` over the True entries of `mask` per segment; `fill` for an empty segment."""
    out = torch.full((num_segments,), fill, dtype=values.dtype, device=values.device)
    src = torch.where(mask, values, torch.full_like(values, fill))
    return out.scatter_reduce(0, seg_ids, src, reduce="amax", include_self=True)


def segment_amin(values: Tensor, mask: Tensor, seg_ids: Tensor, num_segments: int, fill: float) -> Tensor:
    """Min of `values` over the True entries of `mask` per segment; `fill` for an empty segment."""
    return -segment_amax(-values, mask, seg_ids, num_segments, -fill)


def share(flag: Tensor, mask: Tensor) -> Tensor:
    """Share of the True entries of `mask` where `flag` is True (0 when `mask` is empty)."""
    num = (flag & mask).sum().to(torch.float32)
    return num / mask.sum().to(torch.float32).clamp_min(1.0)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over the True entries of `mask` (0 when empty), detached float32."""
    values = values.detach().to(torch.float32)
    return torch.where(mask, values, 0.0).sum() / mask.sum().to(torch.float32).clamp_min(1.0)


def valid_seqs(loss_mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Bool [num_seqs]: the sequence has at least one token with `loss_mask` True."""
    return segment_count(loss_mask, seq_ids, num_seqs, torch.float32) > 0
