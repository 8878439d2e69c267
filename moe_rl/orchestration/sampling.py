"""A rollout's sampling: the recipe's `SamplingSpec`, stopping at the model's EOS, seeded by one
function of (run seed, purpose, step, generation round, engine replica) whose seeds within a run
never coincide (`sampling_seed`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from moe_rl.config.schema import RecipeConfig
from moe_rl.rollout.engine import SamplingSpec


class Purpose(StrEnum):
    """What a rollout is for; each purpose draws from seeds of its own."""

    TRAIN = "train"
    """A training step's batch."""
    EVAL = "eval"
    """Fresh rollouts of the current policy, scored and never trained on (offline DGO)."""
    OFFLINE = "offline"
    """The batches offline DGO trains on, generated once by the starting policy."""
    PROBE = "probe"
    """The mismatch probe's prompts."""


STEP_SPAN = 1 << 32
"""Steps a run can seed (0 .. STEP_SPAN − 1): the distance between two slots' seeds."""
MAX_ROUNDS = 1 << 8
"""Generation rounds a step can seed (`algo.dynamic_sampling_rounds`)."""
MAX_REPLICAS = 1 << 12
"""Engine replicas a round can seed (`rollout.num_engines`)."""
RUN_SEED_STRIDE = 100_003
"""Distance between the seeds of two run seeds' first training step."""


def sampling_seed(run_seed: int, purpose: Purpose, step: int, round_: int = 0, replica: int = 0) -> int:
    """The seed of ``replica``'s sampling in generation round ``round_`` of ``step`` of a
    ``purpose`` rollout: ``run_seed · RUN_SEED_STRIDE + step + STEP_SPAN · slot``, where ``slot``
    numbers (purpose, round, replica) from 0 (a training step's round 0 on replica 0, whose seed is
    therefore ``run_seed · RUN_SEED_STRIDE + step``). Within a run no two of these share a seed:
    the step fills the range below ``STEP_SPAN`` and the slot counts in ``STEP_SPAN``s."""
    for name, value, bound in (("step", step, STEP_SPAN), ("generation round", round_, MAX_ROUNDS),
                               ("engine replica", replica, MAX_REPLICAS)):  # fmt: skip
        if not 0 <= value < bound:
            raise ValueError(f"a sampling seed's {name} must be in [0, {bound}); got {value}")
    slot = (list(Purpose).index(Purpose(purpose)) * MAX_ROUNDS + round_) * MAX_REPLICAS + replica
    return run_seed * RUN_SEED_STRIDE + step + STEP_SPAN * slot


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
