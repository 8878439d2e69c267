"""What a recipe costs, in one value: `estimate` puts the planner's parts together (parameters,
memory per GPU, the weight-sync plan on the machine the recipe describes, a step's time by phase).
``moe-rl plan`` adds every component's rules to it and renders it; the step-time bench predicts
with it."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.derived import target_device
from moe_rl.config.schema import ModelConfig, RecipeConfig
from moe_rl.config.sync_plan import SyncPlan, sync_plan
from moe_rl.errors import ConfigError
from moe_rl.planner.flops import ParamCounts, count_params
from moe_rl.planner.memory import RolloutMemory, TrainerMemory, released_bytes, rollout_memory, trainer_memory
from moe_rl.planner.step_time import StepTime, step_time


@dataclass(frozen=True)
class Estimate:
    """A recipe's cost (see the module docstring)."""

    counts: ParamCounts
    trainer: TrainerMemory
    rollout: RolloutMemory
    sync: SyncPlan | None
    """How every sync moves the weights (None: the recipe's sync route is refused; its rule says why)."""
    step: StepTime | None
    """The step's time by phase (`moe_rl.planner.step_time`); None where it cannot be told."""
    step_unknown: str = ""
    """Why there is no step time: a phase that cannot run, a chip `auto` cannot tell (one line)."""


def recipe_sync_plan(config: RecipeConfig) -> SyncPlan | None:
    """The recipe's weight-sync plan on the machine it describes (`moe_rl.config.derived.
    target_device`); None when its route is refused there."""
    try:
        return sync_plan(config, target_device(config))
    except ValueError:
        return None


def estimate(config: RecipeConfig, teacher: ModelConfig | None = None) -> Estimate:
    """What ``config`` costs, with a distillation ``teacher`` of that architecture where it is known."""
    counts = count_params(config.model)
    trainer = trainer_memory(config, counts, teacher)
    sync = recipe_sync_plan(config)
    try:
        step, unknown = step_time(config, sync, released_bytes(config, trainer)), ""
    except ConfigError as e:
        step, unknown = None, str(e)
    return Estimate(counts, trainer, rollout_memory(config, counts), sync, step, unknown)
