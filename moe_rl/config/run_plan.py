"""The run-wide decisions made once, by the process that starts a run (the driver of `moe-rl train`,
or the one-process loop), and handed to every trainer rank and engine it starts: the device the run
computes on, the weight-sync plan (`moe_rl.config.sync_plan.SyncPlan`) and whether colocated phases
give memory back. No rank and no engine decides them again. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.derived import releases_memory
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import SyncPlan, sync_plan
from moe_rl.device import DeviceKind


@dataclass(frozen=True)
class RunPlan:
    """What every process of a run follows (see the module docstring)."""

    device: DeviceKind
    """What the run computes on (``run.device`` resolved on the machine that starts it)."""
    sync: SyncPlan
    """How weights travel from the trainer to the engines."""
    releases_memory: bool
    """Colocated phases give memory back (`moe_rl.config.derived.releases_memory`): the trainer
    before a generation, the engines after it."""


def run_plan(config: RecipeConfig, device: DeviceKind, in_process: bool = False) -> RunPlan:
    """The `RunPlan` of ``config`` on ``device``; ``in_process``: the one-process loop. Raises
    ``ValueError`` naming the key for a sync route that cannot work."""
    return RunPlan(device, sync_plan(config, device, in_process), releases_memory(config, device))
