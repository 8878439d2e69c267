"""A rollout's sampling: the recipe's `SamplingSpec`, stopping at the model's EOS, seeded by
`moe_rl.rollout.engine.sampling_seed` of (run seed, purpose, step, generation round, engine
replica), whose seeds within a run never coincide."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_rl.config.schema import RecipeConfig
from moe_rl.rollout.engine import Purpose, SamplingSpec, sampling_seed


@dataclass(frozen=True)
class Draw:
    """What a generation round samples for: its purpose, step and round (the seeds of its
    replicas follow, `replica_spec`)."""

    purpose: Purpose
    step: int
    round: int = 0


def replica_spec(config: RecipeConfig, draw: Draw, replica: int) -> SamplingSpec:
    """The sampling of engine replica ``replica`` in the round ``draw``: the recipe's, seeded by
    `sampling_seed`, stopping at EOS."""
    eos = config.model.eos_token_id
    return replace(
        SamplingSpec.from_rollout(config.rollout),
        seed=sampling_seed(config.run.seed, draw.purpose, draw.step, draw.round, replica),
        stop_token_ids=() if eos is None else (eos,),
    )
