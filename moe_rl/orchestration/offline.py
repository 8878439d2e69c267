"""Stored trajectories for offline training (DGO): read, validated against the model, joined."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config.schema import RecipeConfig
from moe_rl.data.shards import read_trajectories
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.errors import ConfigError


def read_offline(config: RecipeConfig, folder: Path) -> TrajectoryBatch:
    """Stored trajectories for offline training, validated like live data against the model
    (token ids, expert ids, kept sets, log-probs): nothing trains on data that fails `validate`."""
    m = config.model
    stored = read_trajectories(
        folder, include_old_logp=False, vocab_size=m.vocab_size, num_experts=m.num_experts or None,
        topk=m.moe_router_topk if m.num_experts else None,
    )  # fmt: skip
    data = TrajectoryBatch.concat(list(stored))
    size = config.rollout.batch_size
    if data.num_samples < size:
        raise ConfigError(
            f"data.trajectories={folder}: {data.num_samples} samples < rollout.batch_size={size}"
        )
    return data
