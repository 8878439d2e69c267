"""The driver's math on a scored batch: its advantages (for DGO the sample weights) with the
zero-variance group counts, and RL-ZVP's signs (shared by the Ray run and the in-process loop)."""

from __future__ import annotations

from torch import Tensor

from moe_rl.algo.advantages import zero_variance_groups, zero_variance_signs
from moe_rl.algo.registry import Bound
from moe_rl.config.schema import RecipeConfig


def step_advantages(estimator: Bound, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Per-sample advantages of a scored batch by the run's ``estimator`` (`registry.bind_step_advantage`:
    for DGO the weights exp(r/β)/mean_group exp(r/β)), with the zero-variance group counts."""
    adv = estimator(rewards=rewards, group_ids=group_ids)
    metrics = {
        f"advantage/{k}": float(v) for k, v in zero_variance_groups(rewards, group_ids).metrics().items()
    }
    metrics["advantage/abs_mean"] = float(adv.abs().mean())
    return adv, metrics


def step_zero_variance(config: RecipeConfig, rewards: Tensor, group_ids: Tensor) -> Tensor | None:
    """Per-sample RL-ZVP signs of a scored batch (`moe_rl.algo.advantages.zero_variance_signs`)
    when `algo.zero_variance_shaping` is on, else None. Each trainer rank turns the signs of its
    samples into token advantages once π_old's entropy is known."""
    if not config.algo.zero_variance_shaping:
        return None
    return zero_variance_signs(rewards, group_ids)
