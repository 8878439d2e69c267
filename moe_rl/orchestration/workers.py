"""The Ray backend of a run's workers (`moe_rl.orchestration.handles`): the trainer group
(`moe_rl.orchestration.trainer_group.TrainerGroup`), the engine pool
(`moe_rl.orchestration.engine_pool.EnginePool`) and the reward worker as an actor (`RayRewarder`),
placed by the driver (`ray_workers`), which decides the run's plan (`moe_rl.config.run_plan`) once
and hands it to every rank and replica. Batches stay in the object store: the engines' batches and
the rank shards are object references, which only the reward worker and the trainer ranks resolve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from moe_rl.config.derived import PlacementMode
from moe_rl.config.run_plan import run_plan
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.device import Machine
from moe_rl.orchestration.actors import PROGRESS_GROUP, RAY_TIMEOUT_S, RewardActor
from moe_rl.orchestration.batches import ScoredSummary
from moe_rl.orchestration.dispatch import Dispatch
from moe_rl.orchestration.engine_pool import EnginePool
from moe_rl.orchestration.handles import Workers
from moe_rl.orchestration.placement import ROLLOUT_NODE, TRAINER_NODE, plan_placement
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.seats import Seats
from moe_rl.orchestration.trainer_group import TrainerGroup
from moe_rl.rewards.pool import PROGRESS_S
from moe_rl.rewards.tasks import Prompt

log = logging.getLogger("moe_rl.driver")


class RayRewarder:
    """The reward worker as a Ray actor, seen from the driver: summaries come back, shards stay in
    the object store (their references go to the trainer ranks)."""

    def __init__(self, config: RecipeConfig, scorer=None):
        actor = ray.remote(concurrency_groups={PROGRESS_GROUP: 1})(RewardActor)  # progress while it scores
        self.actor = actor.options(num_cpus=0).remote(config, scorer)

    def prepare(
        self, batches: Sequence[Any], plan: Dispatch, prompts: Sequence[Prompt], version: int, dp_size: int,
        round_: int = 0, group_ids: Sequence[int] = (),
    ) -> tuple[list, ScoredSummary]:  # fmt: skip
        """``batches``: the replicas' batches by reference."""
        shards, summary = self.actor.prepare.remote(
            batches, plan, prompts, version, dp_size, round_, group_ids
        )
        return self._resolved(shards, summary)

    def prepare_stored(
        self, batch: TrajectoryBatch, version: int, dp_size: int
    ) -> tuple[list, ScoredSummary]:
        shards, summary = self.actor.prepare_stored.remote(ray.put(batch), version, dp_size)
        return self._resolved(shards, summary)

    def _resolved(self, shards, summary) -> tuple[list, ScoredSummary]:
        summary = self._awaited(summary)
        return ray.get(shards, timeout=RAY_TIMEOUT_S), summary

    def _awaited(self, ref):
        """The reward worker's answer; every `PROGRESS_S` it has not come, the scoring's progress
        on the terminal."""
        deadline = time.monotonic() + RAY_TIMEOUT_S
        while not ray.wait([ref], timeout=PROGRESS_S)[0] and time.monotonic() < deadline:
            asked = self.actor.progress.options(concurrency_group=PROGRESS_GROUP).remote()
            line = ray.get(asked, timeout=RAY_TIMEOUT_S)
            if line is not None:
                log.info("scoring with %s", line)
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))

    def dump(self, folder: str, step: int, scored: int) -> None:
        ray.get(self.actor.dump.remote(folder, step, scored), timeout=RAY_TIMEOUT_S)

    def shutdown(self) -> None:
        ray.kill(self.actor)


def _node_roles() -> bool:
    """Whether the Ray cluster's nodes carry the role resources of the sbatch script."""
    resources = ray.cluster_resources()
    return TRAINER_NODE in resources or ROLLOUT_NODE in resources


def ray_workers(config: RecipeConfig, run_dir: Path, inputs: RunInputs) -> Workers:
    """Place and start the trainer group, the reward worker and the engine pool on the Ray cluster
    (engines build their models while the trainer ranks build theirs)."""
    placement = plan_placement(config, Machine.detect(), node_roles=_node_roles())
    plan = run_plan(config, placement.device)  # decided here, once: every rank and replica follows it
    colocated = placement.mode == PlacementMode.COLOCATED
    log.info(
        "placement on %s, %s: %d trainer rank(s) %s, %d engine(s) %s, nodes by role: %s", placement.device,
        placement.mode, placement.trainer_ranks, placement.trainer_bundle(), placement.engines,
        placement.engine_bundle(colocated), "yes" if placement.node_roles else "no",
    )  # fmt: skip
    log.info("weight sync: %s", plan.sync.describe())
    seats = Seats(placement)
    trainer = TrainerGroup(config, seats, plan.sync)
    rewarder = RayRewarder(config, inputs.scorer)
    start_folder = lambda: trainer.save_hf(str(Path(run_dir) / "hf_start"))  # noqa: E731 (vLLM loads it)
    engines = EnginePool(config, seats, plan, inputs.env_factory, start_folder)
    engines.spawn()  # engines build their models while the trainer ranks build theirs
    trainer.form()
    return Workers(trainer, engines, rewarder, plan)
