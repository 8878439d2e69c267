"""The workers of a run behind three handles, so the stages (`moe_rl.orchestration.stages`) run
the same whatever runs them:

* the trainer: ``old_logp(parts) -> BatchHandle``, ``train(BatchHandle)``, ``stream_weights``, checkpoints,
  ``save_hf``, ``dp_size`` / ``world_size`` — the Ray trainer group
  (`moe_rl.orchestration.trainer_group.TrainerGroup`) or one rank in this process;
* the engines: ``generate`` / ``collect``, the sync's ``begin`` / ``finish``, ``probe``, restarts — the
  Ray engine pool (`moe_rl.orchestration.engine_pool.EnginePool`) or one engine in this process;
* the rewarder: ``prepare`` / ``prepare_stored`` / ``dump`` — the reward worker as a Ray actor
  (`RayRewarder`) or `moe_rl.orchestration.batches.Rewarder` in this process.

On Ray, batches stay in the object store: the engines' batches and the rank shards are object
references, which only the rewarder and the trainer ranks resolve. In one process they are the
batches themselves (`moe_rl.orchestration.local`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import ray

from moe_rl.config.derived import PlacementMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import sync_plan
from moe_rl.device import Machine
from moe_rl.orchestration.actors import PROGRESS_GROUP, RAY_TIMEOUT_S, RewardActor
from moe_rl.orchestration.batches import ScoredSummary
from moe_rl.orchestration.engine_pool import EnginePool
from moe_rl.orchestration.placement import ROLLOUT_NODE, TRAINER_NODE, plan_placement
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.seats import Seats
from moe_rl.orchestration.stages import Workers
from moe_rl.orchestration.trainer_group import TrainerGroup
from moe_rl.rewards.pool import PROGRESS_S

log = logging.getLogger("moe_rl.driver")


class RayRewarder:
    """The reward worker as a Ray actor, seen from the driver: summaries come back, shards stay in
    the object store (their references go to the trainer ranks)."""

    def __init__(self, config: RecipeConfig, scorer=None):
        actor = ray.remote(concurrency_groups={PROGRESS_GROUP: 1})(RewardActor)  # progress while it scores
        self.actor = actor.options(num_cpus=0).remote(config, scorer)

    def prepare(
        self, batch_refs: list, plan, prompts, version: int, dp_size: int, round_: int = 0,
        group_ids: Sequence[int] = (),
    ) -> tuple[list, ScoredSummary]:  # fmt: skip
        shards, summary = self.actor.prepare.remote(
            batch_refs, plan, prompts, version, dp_size, round_, group_ids
        )
        return self._resolved(shards, summary)

    def prepare_stored(self, batch, version: int, dp_size: int) -> tuple[list, ScoredSummary]:
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
    colocated = placement.mode == PlacementMode.COLOCATED
    log.info(
        "placement on %s, %s: %d trainer rank(s) %s, %d engine(s) %s, nodes by role: %s", placement.device,
        placement.mode, placement.trainer_ranks, placement.trainer_bundle(), placement.engines,
        placement.engine_bundle(colocated), "yes" if placement.node_roles else "no",
    )  # fmt: skip
    log.info("weight sync: %s", sync_plan(config, placement.device).describe())  # what every rank follows
    seats = Seats(placement)
    trainer = TrainerGroup(config, seats)
    rewarder = RayRewarder(config, inputs.scorer)
    start_folder = lambda: trainer.save_hf(str(Path(run_dir) / "hf_start"))  # noqa: E731 (vLLM loads it)
    engines = EnginePool(config, seats, inputs.env_factory, start_folder)
    engines.spawn()  # engines build their models while the trainer ranks build theirs
    trainer.form()
    return Workers(trainer, engines, rewarder)
