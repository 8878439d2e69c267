"""One optimizer step of a trainer rank and the reductions around it.

Gradients are summed over micro-batches and data-parallel ranks and divided by the global
denominator (``finalize_model_grads(num_tokens=...)``: the local count is all-reduced over
DP×CP), clipped, and the optimizer steps, optionally with the VCPO learning-rate scale. Metrics
are means over micro-batches, then over data-parallel ranks, read to the CPU once per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.algo.corrections import log_importance_ratio
from moe_rl.algo.diagnostics import ess_from_sums, ess_sums, vcpo_lr_factor
from moe_rl.trainer import pipeline
from moe_rl.trainer.batch import TrainMicroBatch


def all_reduce_dp(tensor: Tensor) -> Tensor:
    """``tensor`` summed over the data-parallel (× context-parallel) group, in place."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(tensor, group=ps.get_data_parallel_group(with_context_parallel=True))
    return tensor


def reduce_metrics(
    metrics: Sequence[dict[str, Tensor]], prefix: str, device: torch.device
) -> dict[str, float]:
    """Mean over micro-batches (where each reports the metric), then over data-parallel ranks;
    read to the CPU once."""
    names = sorted({k for m in metrics for k in m})
    if not names:
        return {}
    table = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for m in metrics:
        for i, name in enumerate(names):
            if name in m:
                table[i, 0] += m[name]
                table[i, 1] += 1
    all_reduce_dp(table)
    means = (table[:, 0] / table[:, 1].clamp_min(1)).tolist()
    return {prefix + n: mean for n, mean in zip(names, means)}


def optimizer_step(optimizer, scheduler, lr_scale: float) -> tuple[bool, float | None]:
    """Step with every group's learning rate scaled by ``lr_scale`` for this step only."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    ok, grad_norm, _ = optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler.step(1)
    return ok, grad_norm


def vcpo_scale(mini_batch: Sequence[TrainMicroBatch], device: torch.device, pipelined: bool) -> float:
    """VCPO: ``sqrt(ESS / ESS_ref)`` of the rollout-vs-old token ratios over the mini-batch (all DP
    ranks), with ``ESS_ref = 1`` (the on-policy value of the normalized ESS). π_old lives on the
    last pipeline stage, which tells the others."""
    if pipelined:
        scale = _vcpo_local(mini_batch, device) if pipeline.is_last_stage() else 0.0
        return pipeline.broadcast_from_last_stage(scale)
    return _vcpo_local(mini_batch, device)


def _vcpo_local(mini_batch: Sequence[TrainMicroBatch], device: torch.device) -> float:
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for mb in mini_batch:
        sums += ess_sums(log_importance_ratio(mb.old_logp, mb.micro.rollout_logp).exp())
    all_reduce_dp(sums)
    return float(vcpo_lr_factor(ess_from_sums(sums), 1.0, max_factor=1.0))


def step_metrics(
    loss_sum: Tensor, denom: Tensor, ok: bool, grad_norm, lr_scale: float, lr: float, step: int
) -> dict[str, float]:
    """The ``train/*`` numbers of one optimizer step."""
    total = all_reduce_dp(loss_sum.double().clone())
    loss, denom_value = torch.stack([total / denom.double().clamp_min(1e-12), denom.double()]).tolist()
    return {
        "train/loss": loss,
        "train/denominator": denom_value,
        "train/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
        "train/update_ok": float(ok),
        "train/lr": lr,
        "train/lr_scale": lr_scale,
        "train/step": float(step + 1),
    }
