"""What the trainer group gets of a step's batch: each data-parallel rank's part (`RankPart`: its
shard, its samples' advantages and RL-ZVP signs, its share of the mini-batch plan), and what it
gives back after the π_old pass (`BatchHandle`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moe_rl.data.packing import RankShare, ShardPlan


@dataclass(frozen=True)
class RankPart:
    """What one data-parallel rank trains on in a step: its shard of the batch (in the object
    store, fetched by the rank), its samples' advantages (and RL-ZVP signs) and its share of the
    mini-batch plan (`moe_rl.trainer.batch.TrainerBatch.of_share`)."""

    trajectories: Any
    """The shard's `TrajectoryBatch`, or an object reference to it."""
    advantages: Tensor
    share: RankShare
    zvp_signs: Tensor | None = None


def rank_parts(
    plan: ShardPlan, shards: Sequence[Any], advantages: Tensor, zvp_signs: Tensor | None
) -> list[RankPart]:
    """Per data-parallel rank, its `RankPart`: the one place that reads the plan's layout."""
    return [
        RankPart(shard, advantages[idx], plan.rank(dp), None if zvp_signs is None else zvp_signs[idx])
        for dp, (shard, idx) in enumerate(zip(shards, plan.indices, strict=True))
    ]


@dataclass(frozen=True)
class BatchHandle:
    """A step's batch after the π_old pass: the handle under which every trainer rank keeps its
    `moe_rl.trainer.batch.PreparedBatch` until the group's ``train`` takes it, and the pass's
    ``old/*`` metrics."""

    handle: int
    metrics: dict[str, float]
