"""The verbs a run's steps call on its workers, as typed interfaces: the trainer (`TrainerHandle`),
the engines (`EnginesHandle`) and the reward worker (`RewarderHandle`), held together by `Workers`.

Two backends implement each: the Ray run's (`moe_rl.orchestration.trainer_group.TrainerGroup`,
`moe_rl.orchestration.engine_pool.EnginePool`, `moe_rl.orchestration.workers.RayRewarder`) and the
one-process loop's (`moe_rl.orchestration.local.LocalTrainer`, `moe_rl.orchestration.local.
LocalEngines`, `moe_rl.orchestration.batches.Rewarder`). The stages (`moe_rl.orchestration.stages`)
and the weight-sync coordinator (`moe_rl.weight_sync.coordinator`) call only what is declared here,
so a verb added to a step is added here first, and a test holds both backends to it
(``tests/unit/orchestration/test_handles.py``). Behind both backends a process runs one trainer-side
and one engine-side implementation: `moe_rl.orchestration.trainer_host.TrainerHost` and
`moe_rl.orchestration.engine_host.EngineHost`.

On Ray, batches stay in the object store: the engines' batches and the rank shards are object
references, which only the reward worker and the trainer ranks resolve. In one process they are the
batches themselves. Imports no Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from moe_rl.config.run_plan import RunPlan
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.orchestration.batches import ScoredSummary
from moe_rl.orchestration.dispatch import Dispatch, Generation
from moe_rl.orchestration.rank_parts import BatchHandle, RankPart
from moe_rl.orchestration.replicas import Answers, Replica
from moe_rl.orchestration.sampling import Draw
from moe_rl.rewards.tasks import Prompt
from moe_rl.weight_sync.coordinator import SyncEngines, SyncTrainer


class TrainerHandle(SyncTrainer, Protocol):
    """The trainer: every rank at once, the answer of one (metrics are reduced inside the group)."""

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the shards a batch is cut into."""

    @property
    def world_size(self) -> int:
        """Trainer ranks."""

    def old_logp(self, parts: Sequence[RankPart]) -> BatchHandle:
        """The π_old pass of a step's batch, each rank on the part of its data-parallel rank; `train`
        takes the handle returned."""

    def train(self, prepared: BatchHandle) -> dict[str, float]:
        """One optimizer step per mini-batch of the batch ``prepared`` names."""

    def release_memory(self, params: bool) -> dict[str, float]:
        """What generation does not need out of device memory (colocated)."""

    def restore_memory(self) -> dict[str, float]:
        """What `release_memory` moved out, back."""

    def save_hf(self, directory: str) -> str:
        """The current weights as a Hugging Face folder."""

    def save_checkpoint(self, directory: str) -> None:
        """The trainer's state (weights, optimizer, scheduler, RNG) into ``directory``."""

    def load_checkpoint(self, directory: str) -> int:
        """The state `save_checkpoint` wrote; the step it holds."""

    def shutdown(self) -> None: ...


class EnginesHandle(SyncEngines, Protocol):
    """The rollout engine replicas (`SyncEngines`: their part of a sync)."""

    @property
    def restarts(self) -> int:
        """Replica restarts so far."""

    def start(self) -> None:
        """Every replica started (the first sync follows)."""

    def generate(self, prompts: list[Prompt], draw: Draw, group_ids: list[int]) -> Generation:
        """Start generating ``prompts`` (``group_size`` samples each), spread over the replicas."""

    def collect(self, gen: Generation) -> list[Replica]:
        """Wait for ``gen``; the replicas restarted on the way (their prompts not generated)."""

    def regenerate(self, gen: Generation, replicas: list[Replica]) -> None:
        """Generate again the prompts of ``replicas`` (restarted, at the current weights)."""

    def sleep(self, replicas: list[Replica] | None = None) -> Answers:
        """The replicas give their memory back (colocated; `cluster.engine_sleep_level`)."""

    def wake_up(self) -> Answers:
        """The replicas take their memory again."""

    def probe(self, prompts: list[Prompt]) -> dict[str, float | str]:
        """The zero-update mismatch probe on the first replica."""

    def shutdown(self) -> None: ...


class RewarderHandle(Protocol):
    """The reward worker: merges, scores, validates and shards rollout batches; the caller reads
    only their summary."""

    def prepare(
        self, batches: Sequence[Any], plan: Dispatch, prompts: Sequence[Prompt], version: int, dp_size: int,
        round_: int = 0, group_ids: Sequence[int] = (),
    ) -> tuple[list[Any], ScoredSummary]:  # fmt: skip
        """``(shards, summary)`` of a round's batches, one per replica with prompts."""

    def prepare_stored(
        self, batch: TrajectoryBatch, version: int, dp_size: int
    ) -> tuple[list[Any], ScoredSummary]:
        """``(shards, summary)`` of a stored batch (offline)."""

    def dump(self, folder: str, step: int, scored: int) -> None:
        """The batch of `ScoredSummary.scored` ``scored`` as trajectory shards in ``folder``."""

    def shutdown(self) -> None: ...


@dataclass
class Workers:
    """A run's trainer, engines and reward worker, and the run-wide plan they were started with
    (`moe_rl.config.run_plan.RunPlan`, decided once by the process that started them)."""

    trainer: TrainerHandle
    engines: EnginesHandle
    rewarder: RewarderHandle
    plan: RunPlan

    def shutdown(self) -> None:
        """Every worker ended, the engines first; each is ended even when one before it fails."""
        with contextlib.ExitStack() as stack:
            for worker in (self.rewarder, self.trainer, self.engines):  # callbacks run last first
                stack.callback(worker.shutdown)
