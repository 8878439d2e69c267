"""Group-relative advantages, the responses' scores of the token-level estimators, the
zero-variance-group report and RL-ZVP shaping.

Sequence-level functions take ``rewards`` [S] (one per response) and ``group_ids`` [S] (any
integer ids; responses with the same id answer the same prompt). They return per-response
advantages [S]; broadcast to tokens with ``adv[seq_ids]``.

A group of one response has advantage 0 under every estimator (nothing to compare with) and
counts as a zero-variance group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo._ops import check_1d, check_num_seqs, check_tokens, segment_amax, segment_amin, segment_sum


def _groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, int]:
    check_1d("rewards", rewards)
    check_1d("group_ids", group_ids, rewards.numel())
    if group_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float tensor, got {rewards.dtype}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def _group_mean_count(rewards: Tensor, inverse: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    count = segment_sum(torch.ones_like(rewards), inverse, num_groups)
    mean = segment_sum(rewards, inverse, num_groups) / count
    return mean, count


def grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO [DeepSeekMath, arXiv 2402.03300]: ``A_i = (R_i − mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased (n−1) standard deviation, as ``torch.std`` in the reference
    implementations; a group of one response gets A = 0, and so does a zero-variance group
    even with eps = 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    inverse, num_groups = _groups(rewards, group_ids)
    mean, count = _group_mean_count(rewards, inverse, num_groups)
    centered = rewards - mean[inverse]
    var = segment_sum(centered**2, inverse, num_groups) / (count - 1).clamp_min(1.0)
    scale = var.sqrt()[inverse] + eps
    return torch.where(scale > 0, centered / scale.clamp_min(torch.finfo(scale.dtype).tiny), 0.0)


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO [arXiv 2503.20783] / DeepSeek-V3.2: ``A_i = R_i − mean_g`` (no std division)."""
    inverse, num_groups = _groups(rewards, group_ids)
    mean, _ = _group_mean_count(rewards, inverse, num_groups)
    return rewards - mean[inverse]


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO [Ahmadian et al., arXiv 2402.14740]: ``A_i = R_i − mean_{j≠i} R_j = n/(n−1)·(R_i − mean_g)``."""
    inverse, num_groups = _groups(rewards, group_ids)
    mean, count = _group_mean_count(rewards, inverse, num_groups)
    n = count[inverse]
    return (rewards - mean[inverse]) * n / (n - 1).clamp_min(1.0)


def outcome(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Each response's own reward, ``s_i = R_i``: the score GAE and REINFORCE++ place on a response's
    last token (the trainer turns it into token advantages, `moe_rl.algo.returns`). `group_ids` is
    read only to check it: these estimators compare nothing within a group."""
    _groups(rewards, group_ids)
    return rewards.clone()


@dataclass
class ZeroVarianceReport:
    """Groups whose rewards are all equal (they carry no GRPO signal).

    Attributes:
        num_groups: number of groups (0-d long tensor).
        num_zero_variance: number of groups with all rewards equal (0-d long tensor).
        seq_zero_variance: [S] bool, the response belongs to a zero-variance group.
    """

    num_groups: Tensor
    num_zero_variance: Tensor
    seq_zero_variance: Tensor

    def metrics(self) -> dict[str, Tensor]:
        share = self.num_zero_variance.float() / self.num_groups.float().clamp_min(1.0)
        return {"zero_variance_groups": self.num_zero_variance.float(), "zero_variance_group_share": share}


def zero_variance_groups(rewards: Tensor, group_ids: Tensor) -> ZeroVarianceReport:
    """Count groups whose rewards are exactly equal (``max_g == min_g``; a group of one counts)."""
    inverse, num_groups = _groups(rewards, group_ids)
    ones = torch.ones_like(rewards, dtype=torch.bool)
    hi = segment_amax(rewards, ones, inverse, num_groups, -torch.inf)
    lo = segment_amin(rewards, ones, inverse, num_groups, torch.inf)
    flat = hi == lo
    return ZeroVarianceReport(
        num_groups=torch.tensor(num_groups, device=rewards.device),
        num_zero_variance=flat.sum(),
        seq_zero_variance=flat[inverse],
    )


def zero_variance_signs(rewards: Tensor, group_ids: Tensor, *, correct_threshold: float = 0.5) -> Tensor:
    """Per response [S] int8: +1 in an all-correct zero-variance group (group reward ≥
    `correct_threshold`), −1 in an all-wrong one, 0 elsewhere. Computed over the whole rollout
    batch, since a group may be split over micro-batches and data-parallel ranks."""
    report = zero_variance_groups(rewards, group_ids)
    sign = torch.where(rewards >= correct_threshold, 1, -1).to(torch.int8)
    return torch.where(report.seq_zero_variance, sign, torch.zeros_like(sign))


def zvp_shape(
    token_advantages: Tensor,
    entropy: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    num_seqs: int,
    signs: Tensor,
    alpha: float = 0.1,
) -> Tensor:
    """RL-ZVP's entropy-guided token advantages for zero-variance groups [arXiv 2509.21880], where
    `signs` [S] (`zero_variance_signs`, over the whole batch) is non-zero: ``α·sg(H_t)`` for +1
    (all-correct), ``−α·(max_k H_k − H_t)`` for −1 (all-wrong; max over the response's tokens
    with `loss_mask` True); `token_advantages` (e.g. GRPO's, 0 on those groups) elsewhere. The
    trainer applies it per micro-batch once π_old's entropy [T] is known; α is ours at 0.1 (the
    paper tunes it per model)."""
    check_num_seqs(num_seqs)
    check_tokens(loss_mask, seq_ids, token_advantages=token_advantages, entropy=entropy)
    check_1d("signs", signs, num_seqs)
    h = entropy.detach().to(token_advantages.dtype)
    h_max = segment_amax(h, loss_mask, seq_ids, num_seqs, 0.0)[seq_ids]
    sign = signs[seq_ids]
    shaped = torch.where(sign > 0, alpha * h, -alpha * (h_max - h))
    return torch.where((sign != 0) & loss_mask, shaped, token_advantages)
