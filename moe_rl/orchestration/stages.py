"""The stages of an RL step, each a named method the driver calls in order, and the run state they
share: the workers (trainer, engines, rewarder: `moe_rl.orchestration.workers`), the weight-sync
coordinator, the prompt stream, checkpoints.

The stages run against the workers' handles, so the Ray run and the one-process loop
(`moe_rl.orchestration.local`) are the same loop. On Ray, rollout batches never pass through the
driver: the engine replicas' batches stay in the object store, the reward worker merges, scores
and shards them there, and each trainer rank fetches its own shard (`moe_rl.orchestration.
batches`, `moe_rl.orchestration.rank_parts`). The driver reads summaries (rewards, group ids, lengths) and computes the advantages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl import run_dir
from moe_rl.algo.modes import Objective
from moe_rl.config.derived import releases_memory
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.device import Machine, resolve_device
from moe_rl.diagnostics.budget import staleness_metrics
from moe_rl.envs.rollout import env_metrics
from moe_rl.offload import GIB
from moe_rl.orchestration.advantages import step_advantages, step_zero_variance
from moe_rl.orchestration.batches import ScoredSummary
from moe_rl.orchestration.dispatch import Generation
from moe_rl.orchestration.offline import read_offline
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.rank_parts import BatchHandle, rank_parts
from moe_rl.orchestration.sampling import step_spec
from moe_rl.orchestration.weight_sync import WeightSync
from moe_rl.rewards.registry import build_prompt_source
from moe_rl.rewards.tasks import Prompt
from moe_rl.weight_sync.receiver import SyncTarget

log = logging.getLogger("moe_rl.driver")

# Step numbers (seeds, group ids) of rollouts that are not training steps.
OFFLINE_STEP = 20_000_000
PROBE_SEED_OFFSET = 7919
EVAL_STEP = 10_000_000
FLAT_REWARD_STEPS = 5
"""Steps in a row without reward variance in any group after which a run warns (once per stretch)."""


@dataclass
class Workers:
    """A run's trainer, engines and rewarder, behind the handles the stages use (the Ray ones:
    `moe_rl.orchestration.workers`; the one-process ones: `moe_rl.orchestration.local`)."""

    trainer: Any
    engines: Any
    rewarder: Any

    def shutdown(self) -> None:
        self.engines.shutdown()
        self.trainer.shutdown()
        with contextlib.suppress(AttributeError):
            self.rewarder.shutdown()


@dataclass
class PendingRollout:
    """A generation in flight: its replicas' work, its prompts, and the prompt stream before them."""

    step: int
    generation: Generation
    prompts: list[Prompt]
    source_state: dict
    round_: int = 0
    """The step's generation round (dynamic sampling generates more than one)."""


@dataclass
class Rollout:
    """A scored rollout batch: its data-parallel shards (on Ray: in the object store) and its summary."""

    shards: list[Any]
    summary: ScoredSummary


class Stages:
    """Everything one run needs between steps (see `moe_rl.orchestration.driver`)."""

    def __init__(self, config: RecipeConfig, run_dir: Path | None, workers: Workers, inputs: RunInputs):
        """``run_dir``: where checkpoints and dumps go (None for a run that writes neither)."""
        self.config, self.run_dir = config, None if run_dir is None else Path(run_dir)
        self.workers = workers
        self.trainer, self.engines, self.rewarder = workers.trainer, workers.engines, workers.rewarder
        self.sync = WeightSync(self.trainer, self.engines)
        self.source = inputs.prompt_source
        self.offline_data = inputs.offline_data
        self.step_done = -1
        self.num_stale_rejected = 0
        self._pending_state: dict = {}
        self._probe_source = None
        self._flat_steps = 0  # steps in a row whose groups' rewards had no variance
        self.releases = releases_memory(config, resolve_device(config.run.device, Machine.detect()))
        """Colocated phases give memory back (`cluster.release_memory`)."""

    # ------------------------------------------------------------------ start / resume
    def start(self) -> int:
        self.engines.start()
        self.sync.run(0)
        return 0

    def restore(self, sink) -> int:
        """Continue from the newest complete, intact checkpoint (`run_dir.newest_usable`); metrics
        and checkpoints after it are dropped only once it has loaded."""
        usable = run_dir.newest_usable(self.run_dir)
        if usable is None:  # e.g. a Slurm job requeued before its first checkpoint
            log.warning("--resume %s: no checkpoint yet; starting from step 0", self.run_dir)
            sink.resume_from(0)
            return self.start()
        state = json.loads((usable.path / "driver.json").read_text())
        self.trainer.load_checkpoint(str(usable.path / "trainer"))
        self.source.load_state(state["source"])
        self.step_done = state["step"]
        self.num_stale_rejected = state["num_stale_rejected"]
        self.engines.start()
        self.sync.run(state["version"])
        run_dir.set_aside_newer(usable.path.parent, self.step_done)
        sink.resume_from(self.step_done + 1)
        log.info(
            "resumed from %s at step %d (policy version %d)", usable.path, self.step_done + 1, self.version
        )
        return self.step_done + 1

    # ------------------------------------------------------------------ stages
    def launch_rollout(self, step: int, round_: int = 0, num_prompts: int | None = None) -> PendingRollout:
        """Draw the step's prompts (``num_prompts`` of them in a later round of dynamic sampling)
        and start generating them on the engine pool."""
        state = self.source.state()
        prompts = self.source.next_batch(num_prompts or self._groups)
        group_ids = [step * self._groups + i for i in range(len(prompts))]  # unique within a round
        generation = self.engines.generate(prompts, step_spec(self.config, step, round_), group_ids)
        if round_ == 0:
            self._pending_state[step] = state
        return PendingRollout(step, generation, prompts, state, round_)

    @property
    def _groups(self) -> int:
        return self.config.rollout.batch_size // self.config.rollout.group_size

    def rollout(self, step: int, pending: PendingRollout | None) -> tuple[Rollout, dict[str, Any]]:
        """Generate (or collect the generation started earlier); score, validate and shard it in the
        reward worker; reject batches that are too stale and generate again."""
        t0, reward_s = time.perf_counter(), 0.0
        for launched in [s for s in self._pending_state if s < step]:  # a checkpoint needs only later ones
            del self._pending_state[launched]
        regenerated = self.engines.regenerated_prompts
        memory = self._release_before_generation() if self.releases else {}
        while True:
            pending = pending if pending is not None and pending.step == step else self.launch_rollout(step)
            refs = self._collect(pending.generation)
            t_reward = time.perf_counter()
            shards, summary = self.rewarder.prepare(
                refs, pending.generation.plan, pending.prompts, self.version, self.trainer.dp_size,
                pending.round_, [step * self._groups + i for i in range(self._groups)],
            )  # fmt: skip
            reward_s += time.perf_counter() - t_reward
            if summary.more:  # dynamic sampling: groups whose rewards all agree were dropped
                pending = self.launch_rollout(step, pending.round_ + 1, summary.more)
                continue
            if summary.stale is None:
                break
            self.num_stale_rejected += summary.num_samples
            log.warning("rejected a stale batch: %s", summary.stale)
            pending = None
        if self.releases:
            memory.update(self._restore_after_generation())
        rollout = Rollout(shards, summary)
        metrics = {
            "time/rollout_s": time.perf_counter() - t0 - reward_s,
            "time/reward_s": reward_s,  # merge, score, validate and shard in the reward worker
            "policy/version": self.version,
            "policy/batch_min_version": summary.min_version,
            "policy/staleness": self.version - summary.min_version,
            "rollout/stale_rejected_samples": self.num_stale_rejected,
            "rollout/engines": len(self.engines.replicas),
            "rollout/regenerated_prompts": self.engines.regenerated_prompts - regenerated,
            "trainer/world_size": self.trainer.world_size,
            **env_metrics([status.get("env", {}) for status in pending.generation.statuses.values()]),
            **summary.metrics,
            **memory,
        }
        return rollout, metrics

    def _collect(self, generation: Generation) -> list[Any]:
        """The replicas' batches of ``generation`` (refs on Ray); a replica that died is restarted,
        brought to the current weights and generates its prompts again."""
        while restarted := self.engines.collect(generation):
            self.sync.bring_up(restarted, self.version)
            self.engines.regenerate(generation, restarted)
        return generation.batch_refs()

    def _release_before_generation(self) -> dict[str, float]:
        """Colocated: the trainer's optimizer state and gradients (and parameters, with
        `cluster.offload_params`) leave device memory; the engines take theirs again."""
        released = self.trainer.release_memory(self.config.cluster.offload_params)
        awake = self.engines.wake_up()
        self.sync.bring_up(awake.restarted, self.version)  # new processes, awake
        return {
            "memory/trainer_released_gib": released["released_bytes"] / GIB,
            "memory/trainer_generate_gib": released["resident_bytes"] / GIB,
            "memory/trainer_releases": 1,
        }

    def _restore_after_generation(self) -> dict[str, float]:
        """Colocated: the engines give their memory back (`cluster.engine_sleep_level`); the trainer
        takes what it released."""
        asleep = self.engines.sleep()
        while asleep.restarted:  # new processes, awake: the current weights, then asleep too
            self.sync.bring_up(asleep.restarted, self.version)
            asleep = asleep.merged(self.engines.sleep(asleep.restarted))
        self.trainer.restore_memory()
        most = asleep.most
        return {
            "memory/engine_generate_gib": most.get("peak_bytes", 0.0) / GIB,  # its generation's footprint
            "memory/engine_asleep_gib": most.get("resident_bytes", 0.0) / GIB,
            "memory/engine_sleeps": 1,
        }

    def reward(self, rollout: Rollout, metrics: dict[str, Any]) -> Rollout:
        """The verifiable rewards the reward worker gave the batch."""
        rewards = rollout.summary.rewards
        metrics.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                "reward/max": float(rewards.max()),
            }
        )
        return rollout

    def advantages(self, rollout: Rollout, metrics: dict[str, Any]) -> torch.Tensor:
        """Per-sample advantages; for DGO the sample weights exp(r/β)/mean_group exp(r/β). Warns once
        when no group's rewards have varied for `FLAT_REWARD_STEPS` steps in a row."""
        adv, found = step_advantages(self.config, rollout.summary.rewards, rollout.summary.group_ids)
        metrics.update(found)
        dgo = self.config.algo.objective == Objective.DGO  # sample weights, never all 0
        flat = not dgo and found.get("advantage/zero_variance_group_share", 0.0) >= 1.0
        self._flat_steps = self._flat_steps + 1 if flat else 0
        if self._flat_steps == FLAT_REWARD_STEPS:
            rewards = rollout.summary.rewards
            log.warning(
                "no group's rewards have varied for %d steps in a row (reward/mean %.3f, min %.3f, max %.3f): "
                "every advantage is 0 and the policy learns nothing; check the reward function and the "
                "task's difficulty, or turn on algo.zero_variance_shaping", FLAT_REWARD_STEPS,
                float(rewards.mean()), float(rewards.min()), float(rewards.max()),
            )  # fmt: skip
        return adv

    def old_logp(self, rollout: Rollout, advantages: torch.Tensor, metrics: dict[str, Any]) -> BatchHandle:
        """π_old on every trainer rank, each on its own part of the batch: its shard (fetched by
        reference), its samples' advantages and, under RL-ZVP, their zero-variance signs."""
        t0 = time.perf_counter()
        summary = rollout.summary
        signs = step_zero_variance(self.config, summary.rewards, summary.group_ids)
        prepared = self.trainer.old_logp(rank_parts(summary.plan, rollout.shards, advantages, signs))
        metrics.update(prepared.metrics)
        metrics["time/old_logp_s"] = time.perf_counter() - t0
        return prepared

    def train(self, prepared: BatchHandle, metrics: dict[str, Any]) -> None:
        """One optimizer step per mini-batch of the batch ``prepared`` on every rank."""
        t0 = time.perf_counter()
        metrics.update(self.trainer.train(prepared))
        metrics["time/train_s"] = time.perf_counter() - t0

    @property
    def version(self) -> int:
        """The policy version the engines hold (the sync coordinator's)."""
        return self.sync.version

    def sync_weights(self, version: int, metrics: dict[str, Any]) -> None:
        """Stream the new weights to every engine replica (bucket by bucket, quantized per recipe)."""
        t0 = time.perf_counter()
        report = self.sync.run(version)
        self.step_done = version - 1
        metrics.update(report.metrics())
        metrics["time/sync_s"] = time.perf_counter() - t0
        metrics["rollout/engine_restarts"] = self.engines.restarts

    def dump(self, step: int, rollout: Rollout) -> None:
        """Store the step's batch as trajectory shards (`logging.dump_trajectories`)."""
        if self.config.logging.dump_trajectories:
            folder = self.run_dir / "trajectories" / f"step_{step:06d}"
            self.rewarder.dump(str(folder), step)

    def maybe_probe(self, step: int, metrics: dict[str, Any]) -> None:
        """Every `logging.diagnose_every` steps, right after a sync: the engine-vs-trainer mismatch
        at equal weights on fresh prompts (a stream of its own; never trained on), and the mismatch
        budget (`moe_rl.diagnostics.budget`) with what staleness added to the step's batch."""
        every = self.config.logging.diagnose_every
        if not every or (step + 1) % every:
            return
        if self._probe_source is None:
            self._probe_source = build_prompt_source(self.config)
            self._probe_source.rng.seed(self.config.run.seed + PROBE_SEED_OFFSET)
        prompts = self._probe_source.next_batch(
            self.config.rollout.batch_size // self.config.rollout.group_size
        )
        self.sync.run(self.version, SyncTarget.REFERENCE, self.engines.replicas[:1])  # full precision
        metrics.update(self.engines.probe(prompts))
        metrics.update(staleness_metrics(metrics))

    # ------------------------------------------------------------------ offline (DGO)
    def offline_dataset(self) -> list[TrajectoryBatch]:
        """Stored trajectories (`data.trajectories`), or `data.offline_batches` rollout batches
        generated once with the starting policy and stored in `<run_dir>/offline_data`."""
        data = self.offline_data  # `data.trajectories`: read and validated by the preflight
        if data is None:
            folder = self.run_dir / "offline_data"
            done = folder / "complete"
            if not done.exists():
                for i in range(self.config.data.offline_batches):
                    self.rollout(OFFLINE_STEP + i, None)  # scored by the reward worker, which writes it
                    part = folder / f"batch_{i:04d}"
                    self.rewarder.dump(str(part), OFFLINE_STEP + i)
                done.write_text("")
            data = read_offline(self.config, Path(folder))
        size = self.config.rollout.batch_size
        return [data.slice(i, i + size) for i in range(0, data.num_samples - size + 1, size)]

    def offline_batch(self, dataset: list[TrajectoryBatch], step: int) -> tuple[Rollout, dict[str, Any]]:
        """The step's slice of the stored data (epochs cycle over it), sharded by the reward worker."""
        batch = dataset[step % len(dataset)]
        shards, summary = self.rewarder.prepare_stored(batch, self.version, self.trainer.dp_size)
        rollout = Rollout(shards, summary)
        return rollout, {
            "offline/epoch": step // len(dataset),
            "offline/reward_mean": float(batch.rewards.mean()),
            "policy/version": self.version,
            "trainer/world_size": self.trainer.world_size,
            **summary.metrics,
        }

    def evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        """Reward of fresh rollouts from the current policy (not trained on)."""
        rollout, rollout_metrics = self.rollout(EVAL_STEP + step, None)
        self.reward(rollout, rollout_metrics)
        metrics.update({k: v for k, v in rollout_metrics.items() if k.startswith(("reward/", "time/"))})

    # ------------------------------------------------------------------ checkpoints
    def maybe_checkpoint(self, step: int) -> None:
        """Checkpoint after `step` every `run.checkpoint_every` steps (the last step is saved anyway)."""
        every = self.config.run.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.config.run.steps:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Trainer state + driver state after the last finished step (none finished: nothing),
        sealed by a manifest written last (`run_dir.write_manifest`)."""
        if self.step_done < 0:
            return
        run_dir.ensure_owned(self.run_dir)  # this run still holds its directory
        step = self.step_done
        name = f"step_{step:06d}"
        folder = self.run_dir / "checkpoints"
        ckpt = folder / name
        if run_dir.verify(ckpt) is None:  # this step is saved already (a stop right after a checkpoint)
            return
        (ckpt / run_dir.MANIFEST).unlink(missing_ok=True)  # not complete until sealed again
        ckpt.mkdir(parents=True, exist_ok=True)
        try:
            self.trainer.save_checkpoint(str(ckpt / "trainer"))
        except Exception as exc:
            full = run_dir.disk_full(ckpt, f"checkpoint {name}")
            if full is not None:
                raise full from exc
            raise
        source = self._pending_state.get(step + 1, self.source.state())
        state = {
            "step": step,
            "version": self.version,
            "num_stale_rejected": self.num_stale_rejected,
            "source": _jsonable(source),
        }
        (ckpt / "driver.json").write_text(json.dumps(state))
        run_dir.write_manifest(ckpt)
        run_dir.mark_latest(folder, name)
        log.info("checkpoint %s", ckpt)

    def shutdown(self) -> None:
        self.workers.shutdown()


def _jsonable(state: dict) -> dict:
    version, internal, gauss = state["rng"]
    return {"rng": [version, list(internal), gauss], "order": state["order"]}
