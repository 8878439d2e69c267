"""The stages of an RL step, each a named method the loop (`moe_rl.orchestration.loop`) calls in
order and each returning its result and its metrics, over what they share: the workers behind
their typed handles (`moe_rl.orchestration.handles`), the weight-sync coordinator, the prompt stream
and the run's state between steps (`moe_rl.orchestration.run_state.RunState`, which checkpoints
store). What is around the steps (start, restore, checkpoints, offline data) is the run's
(`moe_rl.orchestration.run.Run`).

The stages run against the workers' handles, so the Ray run and the one-process loop
(`moe_rl.orchestration.local`) are the same loop. On Ray, rollout batches never pass through the
driver: the engine replicas' batches stay in the object store, the reward worker merges, scores
and shards them there (`moe_rl.orchestration.batches`), and each trainer rank fetches its own
shard (`moe_rl.orchestration.rank_parts`). The driver reads summaries (rewards, group ids,
lengths) and computes the advantages.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_rl.algo import registry
from moe_rl.algo.modes import OFFLINE_OBJECTIVES, Objective
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.diagnostics.budget import staleness_metrics
from moe_rl.envs.rollout import env_metrics
from moe_rl.offload import GIB
from moe_rl.orchestration.advantages import step_advantages, step_zero_variance
from moe_rl.orchestration.batches import ScoredSummary
from moe_rl.orchestration.dispatch import Generation
from moe_rl.orchestration.handles import EnginesHandle, RewarderHandle, TrainerHandle, Workers
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.rank_parts import BatchHandle, rank_parts
from moe_rl.orchestration.run_state import RunState
from moe_rl.orchestration.sampling import Draw, Purpose, sampling_seed
from moe_rl.rewards.datasets import PromptSource
from moe_rl.rewards.tasks import Prompt
from moe_rl.weight_sync.coordinator import WeightSync
from moe_rl.weight_sync.protocol import SyncTarget

log = logging.getLogger("moe_rl.driver")

FLAT_REWARD_STEPS = 5
"""Steps in a row without reward variance in any group after which a run warns (once per stretch)."""


def driver_readings(answer: dict[str, float]) -> dict[str, float]:
    """The driver's memory figures in a trainer's or an engine's answer (`moe_rl.offload.DriverMemory`:
    already metrics, on CUDA only)."""
    return {k: v for k, v in answer.items() if k.startswith("memory/")}


@dataclass
class Rounds:
    """A step's generation rounds (of a `Purpose`: a training step's, an evaluation's, an offline
    batch's), the one in flight: its replicas' work (`generation`), its prompts and its number.
    Round 0 draws the step's prompts; with dynamic sampling, a batch not yet full is followed by a
    round over the prompts it still lacks; a batch too stale to train on is followed by round 0
    again, over new prompts (`Stages.next_round`)."""

    purpose: Purpose
    step: int
    generation: Generation
    prompts: list[Prompt]
    round: int = 0
    regenerated: int = 0
    """Prompts generated again over the rounds, because their replica died (`Stages.collect`)."""
    reward_s: float = 0.0
    """Seconds the reward worker took over the rounds (`Stages.reward`)."""

    def metrics(self) -> dict[str, float]:
        return {"rollout/regenerated_prompts": self.regenerated, "time/reward_s": self.reward_s}


@dataclass(frozen=True)
class Waiting:
    """What the driver waits for in a phase that runs the user's code (the reward worker's
    scoring), and since when (`time.monotonic`): a stop request waits a little for it, then gives
    up waiting (`moe_rl.orchestration.driver.StopRequest`)."""

    what: str
    since: float = field(default_factory=time.monotonic)


@dataclass
class Rollout:
    """A scored rollout batch: its data-parallel shards (on Ray: in the object store), its summary
    and, for a batch to train on, its metrics (rewards, lengths, versions)."""

    shards: list[Any]
    summary: ScoredSummary
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable(self) -> bool:
        """Complete and fresh enough to train on (else another round follows)."""
        return self.summary.trainable


class Stages:
    """Everything one run needs between steps (see the module docstring)."""

    def __init__(self, config: RecipeConfig, run_dir: Path | None, workers: Workers, inputs: RunInputs):
        """``run_dir``: where trajectory dumps go (None for a run that writes none)."""
        self.config, self.run_dir = config, None if run_dir is None else Path(run_dir)
        self.workers = workers
        self.trainer: TrainerHandle = workers.trainer
        self.engines: EnginesHandle = workers.engines
        self.rewarder: RewarderHandle = workers.rewarder
        self.sync = WeightSync(self.trainer, self.engines)
        self.source = inputs.prompt_source
        self.state = RunState()
        a = config.algo
        self.estimator = registry.bind_step_advantage(a.objective, a.advantage, a.dgo_beta)
        """The driver's part of each step's advantages, bound once (`registry.bind_step_advantage`)."""
        self.sampled = a.objective != Objective.SFT
        """The batches came from a sampling policy, so a step reports their drift from it (``old/*``)
        and, offline, their stored rewards; SFT's demonstrations did not (no policy wrote them)."""
        self.waiting: Waiting | None = None
        """The phase running the user's code the driver waits for now (None: none)."""

    # ------------------------------------------------------------------ rollout
    def generate(self, step: int, purpose: Purpose = Purpose.TRAIN) -> Rounds:
        """Draw the step's prompts and start generating them on the engine pool (round 0)."""
        generation, prompts = self._launch(Draw(purpose, step), self._groups)
        return Rounds(purpose, step, generation, prompts)

    def next_round(self, rounds: Rounds, batch: Rollout) -> None:
        """The step's next generation round, after a ``batch`` not to train on: one too stale is
        counted (never trained on) and the step starts over with new prompts (round 0); with
        dynamic sampling, a round over the prompts the batch still lacks."""
        summary = batch.summary
        if summary.stale is not None:
            self.state.stale_rejected += summary.num_samples
            log.warning("rejected a stale batch: %s", summary.stale)
            next_round, num_prompts = 0, self._groups
        else:
            next_round, num_prompts = rounds.round + 1, summary.more
        draw = Draw(rounds.purpose, rounds.step, next_round)
        rounds.generation, rounds.prompts = self._launch(draw, num_prompts)
        rounds.round = next_round

    def _launch(self, draw: Draw, num_prompts: int) -> tuple[Generation, list[Prompt]]:
        state = self.source.state()
        prompts = self.source.next_batch(num_prompts)
        group_ids = [draw.step * self._groups + i for i in range(len(prompts))]  # unique within a round
        generation = self.engines.generate(prompts, draw, group_ids)
        if draw.round == 0 and draw.purpose == Purpose.TRAIN:
            self.state.launched[draw.step] = state
        return generation, prompts

    @property
    def _groups(self) -> int:
        return self.config.rollout.batch_size // self.config.rollout.group_size

    def wake_engines(self) -> dict[str, Any]:
        """Colocated (`cluster.release_memory`): the trainer's optimizer state and gradients (and
        parameters, with `cluster.offload_params`) leave device memory; the engines take theirs
        again. Its memory metrics."""
        if not self.workers.plan.releases_memory:
            return {}
        released = self.trainer.release_memory(self.config.cluster.offload_params)
        awake = self.engines.wake_up()
        self.sync.bring_up(awake.restarted, self.state.version)  # new processes, awake
        return {
            "memory/trainer_released_gib": released["released_bytes"] / GIB,
            "memory/trainer_generate_gib": released["resident_bytes"] / GIB,
            "memory/trainer_weights_gib": released["weights_bytes"] / GIB,
            "memory/trainer_releases": 1,
            **driver_readings(released), **driver_readings(awake.most),  # on CUDA
        }  # fmt: skip

    def collect(self, rounds: Rounds) -> list[Any]:
        """The round's batches, one per replica with prompts (refs on Ray). A replica that died is
        restarted, brought to the current weights and generates its prompts again (counted in
        ``rounds``)."""
        generation = rounds.generation
        while restarted := self.engines.collect(generation):
            self.sync.bring_up(restarted, self.state.version)
            self.engines.regenerate(generation, restarted)
            rounds.regenerated += sum(len(generation.plan.assignment[replica.index]) for replica in restarted)
        return generation.batch_refs()

    def reward(self, rounds: Rounds, batches: list[Any]) -> Rollout:
        """The reward worker merges the round's ``batches`` in prompt order, scores every response,
        validates the batch, checks its staleness and shards it (with dynamic sampling, over the
        step's pool of groups); its time is counted in ``rounds``. A batch to train on brings its
        metrics: rewards, lengths, versions."""
        t0 = time.perf_counter()
        responses = len(rounds.prompts) * self.config.rollout.group_size
        with self._waiting(f"the reward worker to score {responses} responses of step {rounds.step} "
                           f"(data.reward={self.config.data.reward})"):  # fmt: skip
            shards, summary = self.rewarder.prepare(
                batches, rounds.generation.plan, rounds.prompts, self.state.version, self.trainer.dp_size,
                rounds.round, [rounds.step * self._groups + i for i in range(self._groups)],
            )  # fmt: skip
        rounds.reward_s += time.perf_counter() - t0
        batch = Rollout(shards, summary)
        if batch.trainable:
            batch.metrics = self._batch_metrics(rounds, summary)
        return batch

    @contextlib.contextmanager
    def _waiting(self, what: str):
        """While the driver waits for ``what``, which runs the user's code (`Waiting`)."""
        self.waiting = Waiting(what)
        try:
            yield
        finally:
            self.waiting = None

    def _batch_metrics(self, rounds: Rounds, summary: ScoredSummary) -> dict[str, Any]:
        version, rewards = self.state.version, summary.rewards
        return {
            "policy/version": version,
            "policy/batch_min_version": summary.min_version,
            "policy/staleness": version - summary.min_version,
            "rollout/stale_rejected_samples": self.state.stale_rejected,
            "rollout/engines": len(self.engines.replicas),
            "trainer/world_size": self.trainer.world_size,
            **env_metrics([status.get("env", {}) for status in rounds.generation.statuses.values()]),
            **summary.metrics,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/max": float(rewards.max()),
        }

    def sleep_engines(self) -> dict[str, Any]:
        """Colocated: the engines give their memory back (`cluster.engine_sleep_level`); the trainer
        takes what it released. Its memory metrics."""
        if not self.workers.plan.releases_memory:
            return {}
        asleep = self.engines.sleep()
        while asleep.restarted:  # new processes, awake: the current weights, then asleep too
            self.sync.bring_up(asleep.restarted, self.state.version)
            asleep = asleep.merged(self.engines.sleep(asleep.restarted))
        self.trainer.restore_memory()
        return {
            "memory/engine_generate_gib": asleep.most.get("peak_bytes", 0.0) / GIB,  # a generation's
            "memory/engine_asleep_gib": asleep.most.get("resident_bytes", 0.0) / GIB,
            "memory/engine_sleeps": 1,
            **driver_readings(asleep.most),
        }

    # ------------------------------------------------------------------ training
    def advantages(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, Any]]:
        """Per-sample advantages (offline the sample weights: DGO's exp(r/β)/mean_group exp(r/β), SFT's 1) and their
        metrics. Warns once when no group's rewards have varied for `FLAT_REWARD_STEPS` steps in a
        row."""
        adv, found = step_advantages(self.estimator, rollout.summary.rewards, rollout.summary.group_ids)
        weights = self.config.algo.objective in OFFLINE_OBJECTIVES  # sample weights, never all 0
        flat = not weights and found.get("advantage/zero_variance_group_share", 0.0) >= 1.0
        self.state.flat_steps = self.state.flat_steps + 1 if flat else 0
        if self.state.flat_steps == FLAT_REWARD_STEPS:
            rewards = rollout.summary.rewards
            log.warning(
                "no group's rewards have varied for %d steps in a row (reward/mean %.3f, min %.3f, max %.3f): "
                "every advantage is 0 and the policy learns nothing; check the reward function and the "
                "task's difficulty, or turn on algo.zero_variance_shaping", FLAT_REWARD_STEPS,
                float(rewards.mean()), float(rewards.min()), float(rewards.max()),
            )  # fmt: skip
        return adv, found

    def old_logp(self, rollout: Rollout, advantages: torch.Tensor) -> tuple[BatchHandle, dict[str, Any]]:
        """π_old on every trainer rank, each on its own part of the batch: its shard (fetched by
        reference), its samples' advantages and, under RL-ZVP, their zero-variance signs. The
        prepared batch's handle, and the pass's metrics (the mismatch diagnostics among them)."""
        t0 = time.perf_counter()
        summary = rollout.summary
        signs = step_zero_variance(self.config, summary.rewards, summary.group_ids)
        prepared = self.trainer.old_logp(rank_parts(summary.plan, rollout.shards, advantages, signs))
        found = prepared.metrics if self.sampled else _without(prepared.metrics, "old/")
        return prepared, {**found, "time/old_logp_s": time.perf_counter() - t0}

    def train(self, prepared: BatchHandle) -> dict[str, Any]:
        """One optimizer step per mini-batch of the batch ``prepared`` on every rank; its metrics."""
        t0 = time.perf_counter()
        found = self.trainer.train(prepared)
        return {**found, "time/train_s": time.perf_counter() - t0}

    def sync_weights(self, version: int) -> dict[str, Any]:
        """Stream the new weights to every engine replica (bucket by bucket, quantized per recipe);
        the engines hold ``version`` then. The sync's metrics."""
        t0 = time.perf_counter()
        report = self.sync.run(version)
        self.state.version = version
        return {
            **report.metrics(),
            "time/sync_s": time.perf_counter() - t0,
            "rollout/engine_restarts": self.engines.restarts,
        }

    def end_step(self, step: int) -> None:
        """``step`` is done: a checkpoint from now on holds the state after it."""
        self.state.end_step(step)

    def dump(self, step: int, rollout: Rollout) -> None:
        """Store the step's batch, ``rollout``'s, as trajectory shards (`logging.dump_trajectories`)."""
        if self.config.logging.dump_trajectories:
            folder = self.run_dir / "trajectories" / f"step_{step:06d}"
            self.rewarder.dump(str(folder), step, rollout.summary.scored)

    def maybe_probe(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Every `logging.diagnose_every` steps, right after a sync: the engine-vs-trainer mismatch
        at equal weights on fresh prompts (a stream of its own; never trained on), and the mismatch
        budget (`moe_rl.diagnostics.budget`) with what staleness added to the step's batch, whose
        ``metrics`` it reads. Its metrics (none on other steps)."""
        every = self.config.logging.diagnose_every
        if not every or (step + 1) % every:
            return {}
        prompts = self._probe_source.next_batch(self._groups)
        self.sync.run(self.state.version, SyncTarget.REFERENCE, self.engines.replicas[:1])  # full precision
        found = self.engines.probe(prompts)
        return {**found, **staleness_metrics({**metrics, **found})}

    @functools.cached_property
    def _probe_source(self) -> PromptSource:
        """The probe's prompt stream over the run's prompts, seeded apart from the training prompts."""
        return self.source.stream(sampling_seed(self.config.run.seed, Purpose.PROBE, 0))

    # ------------------------------------------------------------------ offline (DGO, SFT)
    def offline_batch(self, dataset: list[TrajectoryBatch], step: int) -> tuple[Rollout, dict[str, Any]]:
        """The step's slice of the stored data (epochs cycle over it), sharded by the reward worker."""
        batch = dataset[step % len(dataset)]
        shards, summary = self.rewarder.prepare_stored(batch, self.state.version, self.trainer.dp_size)
        rollout = Rollout(shards, summary)
        stored = {"offline/reward_mean": float(batch.rewards.mean())} if self.sampled else {}
        return rollout, {
            "offline/epoch": step // len(dataset),
            **stored,
            "policy/version": self.state.version,
            "trainer/world_size": self.trainer.world_size,
            **summary.metrics,
        }


def _without(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {key: value for key, value in metrics.items() if not key.startswith(prefix)}
