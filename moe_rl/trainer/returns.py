"""A token-level estimator's advantages at the π_old pass (``algo.advantage`` = ``gae``,
``reinforce_pp``, ``reinforce_pp_baseline``; the math is `moe_rl.algo.returns`).

The driver sends each response's score broadcast over its tokens as the micro-batch's advantages
(its reward, or its reward less its group's mean: `moe_rl.algo.registry.DRIVER_FUNCS`). Here, once
π_old's (and π_ref's, for a KL in the reward) log-probs and the critic's values are known, each
micro-batch gets its token rewards, returns and advantages, and the advantages are whitened over
the whole batch: the sums of every micro-batch of the rank, added over the data-parallel ranks, so
every rank whitens with the batch's one mean and variance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moe_rl.algo import registry
from moe_rl.algo.returns import whiten, whiten_sums
from moe_rl.trainer.batch import TrainMicroBatch
from moe_rl.trainer.update import all_reduce_dp


def distill_advantages(
    micro_batches: Sequence[TrainMicroBatch], coef: float, device: torch.device
) -> tuple[list[TrainMicroBatch], dict[str, float]]:
    """On-policy distillation (`moe_rl.trainer.teacher`): each token's advantage plus
    ``coef·(gap − mean gap)``, ``gap = teacher_logp − old_logp``, the mean over the batch's response
    tokens (every data-parallel rank's); and ``distill/reverse_kl``, that mean's negative.

    The mean is a baseline: on the student's own samples ``E[∇ log π] = 0``, so subtracting a
    constant leaves the expected gradient of the reverse KL as it is and removes the part of each
    token's term that only says "every sampled token is unlikely under the teacher" (a fresh
    student's gap is about −7 nats on every token), which otherwise drowns the one-sample signal."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    gaps = []
    for mb in micro_batches:
        gap = mb.teacher_logp.float() - mb.old_logp.float()
        sums[0] += gap.numel()
        sums[1] += gap.double().sum()
        gaps.append(gap)
    count, total = all_reduce_dp(sums).tolist()
    mean = total / max(count, 1.0)
    prepared = [
        mb.with_old(advantages=mb.advantages + coef * (gap - mean))
        for mb, gap in zip(micro_batches, gaps, strict=True)
    ]
    return prepared, {"distill/reverse_kl": -mean}


def sample_scores(mb: TrainMicroBatch) -> Tensor:
    """float32 [S]: each response's score, as the driver broadcast it over its tokens."""
    scores = torch.zeros(mb.num_samples, dtype=torch.float32, device=mb.advantages.device)
    return scores.scatter(0, mb.seq_ids, mb.advantages.float())


def token_returns(
    estimator: registry.Bound, micro_batches: Sequence[TrainMicroBatch], values: dict[int, Tensor],
    device: torch.device,
) -> tuple[list[TrainMicroBatch], dict[str, float]]:  # fmt: skip
    """The micro-batches with the estimator's whitened ``advantages`` and its ``returns`` (and the
    critic's ``old_values`` when ``values`` holds them, by ``id(mb)``), and the batch's statistics:
    ``advantage/token_mean_raw`` and ``advantage/token_std_raw`` (before whitening, the unbiased
    standard deviation), ``returns/mean``, ``returns/token_reward_mean``, ``returns/values_mean``."""
    results, sums = [], torch.zeros(6, dtype=torch.float64, device=device)
    for mb in micro_batches:
        inputs = {"values": values[id(mb)]} if values else {}
        out = estimator(
            scores=sample_scores(mb), seq_ids=mb.seq_ids, num_seqs=mb.num_samples, old_logp=mb.old_logp,
            ref_logp=mb.ref_logp, **inputs,
        )  # fmt: skip
        mask = torch.ones_like(out.advantages, dtype=torch.bool)
        sums[:3] += whiten_sums(out.advantages, mask)
        sums[3] += out.returns.double().sum()
        sums[4] += out.rewards.double().sum()
        sums[5] += values[id(mb)].double().sum() if values else 0.0
        results.append(out)
    all_reduce_dp(sums)
    prepared = []
    for mb, out in zip(micro_batches, results):
        mask = torch.ones_like(out.advantages, dtype=torch.bool)
        computed = {
            "advantages": whiten(out.advantages.float(), mask, sums[:3]),
            "returns": out.returns.float(),
        }
        if values:
            computed["old_values"] = values[id(mb)]
        prepared.append(mb.with_old(**computed))
    count, total, squares, returns, rewards, value_sum = sums.tolist()
    mean = total / max(count, 1.0)
    var = max((squares - count * mean * mean) / max(count - 1.0, 1.0), 0.0)
    metrics = {
        "advantage/token_mean_raw": mean,
        "advantage/token_std_raw": var**0.5,
        "returns/mean": returns / max(count, 1.0),
        "returns/token_reward_mean": rewards / max(count, 1.0),
    }
    if values:
        metrics["returns/values_mean"] = value_sum / max(count, 1.0)
    return prepared, metrics
