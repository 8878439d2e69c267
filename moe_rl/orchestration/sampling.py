"""A rollout's sampling: the recipe's `SamplingSpec`, seeded per step, generation round and engine
replica, stopping at the model's EOS."""

from __future__ import annotations

from dataclasses import replace

from moe_rl.config.schema import RecipeConfig
from moe_rl.rollout.engine import SamplingSpec

REPLICA_SEED_STRIDE = 1_000_003
"""Replica r samples with the step's seed + r · stride (one replica: the step's seed)."""


def replica_spec(spec: SamplingSpec, replica: int) -> SamplingSpec:
    """The sampling of replica ``replica`` in a step (its own seed, `REPLICA_SEED_STRIDE`)."""
    return replace(spec, seed=None if spec.seed is None else spec.seed + replica * REPLICA_SEED_STRIDE)


ROUND_SEED_STRIDE = 1_000_003
"""Seed distance between a step's generation rounds (dynamic sampling), beyond any step count."""


def step_spec(config: RecipeConfig, step: int, round_: int = 0) -> SamplingSpec:
    """The sampling of step ``step`` (its generation round ``round_``): the recipe's, seeded by run,
    step and round, stopping at EOS."""
    eos = config.model.eos_token_id
    return replace(
        SamplingSpec.from_rollout(config.rollout),
        seed=config.run.seed * 100_003 + step + ROUND_SEED_STRIDE * round_,
        stop_token_ids=() if eos is None else (eos,),
    )
