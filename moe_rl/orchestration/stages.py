"""The stages of an RL step, each a named method the driver calls in order, and the run state they
share: actors, the prompt stream, the policy version, checkpoints."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch

from moe_rl.algo import registry
from moe_rl.algo.advantages import zero_variance_groups
from moe_rl.algo.objectives import dgo_weights
from moe_rl.config.loader import ConfigError
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.shards import read_shards, write_shards
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.data.validate import check_staleness, validate
from moe_rl.orchestration.actors import EngineActor, RewardActor, TrainerActor, spawn
from moe_rl.rewards.registry import build_prompt_source
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec

log = logging.getLogger("moe_rl.driver")

MAX_ENGINE_RESTARTS = 2
RAY_TIMEOUT_S = 1800.0
# Step numbers (seeds, group ids) of rollouts that are not training steps.
OFFLINE_STEP = 20_000_000
PROBE_SEED_OFFSET = 7919
EVAL_STEP = 10_000_000


@dataclass
class PendingRollout:
    """A generation in flight: its future, its prompts, and the prompt stream before them."""

    step: int
    ref: Any
    prompts: list[Prompt]
    source_state: dict


class EngineSupervisor:
    """Owns the rollout engine actor; restarts it with the current weights if its process dies."""

    def __init__(self, config: RecipeConfig, trainer, run_dir: Path):
        self.config, self.trainer, self.run_dir = config, trainer, run_dir
        self.actor = None
        self.restarts = 0
        self.version = 0

    def start(self, version: int) -> dict[str, float]:
        model_path = None
        if self.config.rollout.engine == "vllm":
            model_path = ray.get(self.trainer.save_hf.remote(str(self.run_dir / "hf_start")))
        self.actor = spawn(EngineActor, self.config, "engine", model_path)
        return self.sync(version)

    def sync(self, version: int) -> dict[str, float]:
        """Send the trainer's weights as `version`; a dead engine is restarted with them."""
        weights = self.trainer.export_weights.remote()
        try:
            out = ray.get(self.actor.update_weights.remote(weights, version), timeout=RAY_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            self._count_restart(exc)
            ray.kill(self.actor)
            return self.start(version)
        self.version = version
        return out

    def _count_restart(self, exc: Exception) -> None:
        self.restarts += 1
        if self.restarts > MAX_ENGINE_RESTARTS:
            raise RuntimeError(f"the rollout engine died {self.restarts} times; last error: {exc}") from exc
        log.error("rollout engine died (%s); restarting it with the current weights", exc)

    def generate(self, prompts: list[Prompt], sampling: SamplingSpec, group_ids: list[int]):
        return self.actor.generate.remote([list(p.ids) for p in prompts], sampling, group_ids)

    def pid(self) -> int:
        return ray.get(self.actor.pid.remote())

    def get(
        self, ref, prompts: list[Prompt], sampling: SamplingSpec, group_ids: list[int]
    ) -> TrajectoryBatch:
        """The batch of `ref`; if the engine died, restart it (current weights) and generate again."""
        while True:
            try:
                return ray.get(ref, timeout=RAY_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                self._count_restart(exc)
                ray.kill(self.actor)
                self.start(self.version)
                ref = self.generate(prompts, sampling, group_ids)
            except ray.exceptions.GetTimeoutError as exc:
                raise RuntimeError(f"the rollout engine did not answer within {RAY_TIMEOUT_S:.0f} s") from exc


class Stages:
    """Everything one run needs between steps (see `moe_rl.orchestration.driver`)."""

    def __init__(self, config: RecipeConfig, run_dir: Path):
        if config.algo.zero_variance_shaping:
            raise ConfigError("algo.zero_variance_shaping=true is not supported by the RL loop yet")
        self.config, self.run_dir = config, Path(run_dir)
        self.trainer = spawn(TrainerActor, config, "trainer")
        self.rewarder = spawn(RewardActor, config, "reward")
        self.engine = EngineSupervisor(config, self.trainer, self.run_dir)
        self.source = build_prompt_source(config)
        self.advantage_fn = registry.bind_advantage(config.algo.advantage)
        eos = config.model.eos_token_id
        self.sampling = SamplingSpec.from_rollout(config.rollout)
        self.stop_tokens = () if eos is None else (eos,)
        self.version = 0
        self.step_done = -1
        self.num_stale_rejected = 0
        self._pending_state: dict = {}
        self._probe_source = None
        self._batch: TrajectoryBatch | None = None

    # ------------------------------------------------------------------ start / resume
    def start(self) -> int:
        self.engine.start(version=0)
        return 0

    def restore(self, sink) -> int:
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():  # e.g. a Slurm job requeued before its first checkpoint
            log.warning("--resume %s: no checkpoint yet; starting from step 0", self.run_dir)
            sink.resume_from(0)
            return self.start()
        ckpt = self.run_dir / "checkpoints" / latest.read_text().strip()
        state = json.loads((ckpt / "driver.json").read_text())
        ray.get(self.trainer.load_checkpoint.remote(str(ckpt / "trainer")))
        self.source.load_state(state["source"])
        self.version, self.step_done = state["version"], state["step"]
        self.num_stale_rejected = state["num_stale_rejected"]
        self.engine.start(version=self.version)
        sink.resume_from(self.step_done + 1)
        log.info("resumed from %s at step %d (policy version %d)", ckpt, self.step_done + 1, self.version)
        return self.step_done + 1

    # ------------------------------------------------------------------ stages
    def _spec(self, step: int) -> SamplingSpec:
        return replace(
            self.sampling, seed=self.config.run.seed * 100_003 + step, stop_token_ids=self.stop_tokens
        )

    def launch_rollout(self, step: int) -> PendingRollout:
        """Draw the step's prompts and start generating them."""
        state = self.source.state()
        prompts = self.source.next_batch(self.config.rollout.batch_size // self.config.rollout.group_size)
        group_ids = [step * len(prompts) + i for i in range(len(prompts))]
        ref = self.engine.generate(prompts, self._spec(step), group_ids)
        self._pending_state[step] = state
        return PendingRollout(step, ref, prompts, state)

    def rollout(self, step: int, pending: PendingRollout | None) -> tuple[TrajectoryBatch, dict[str, Any]]:
        """Generate (or collect the generation started earlier); reject batches that are too stale."""
        t0 = time.perf_counter()
        while True:
            pending = pending if pending is not None and pending.step == step else self.launch_rollout(step)
            group_ids = [step * len(pending.prompts) + i for i in range(len(pending.prompts))]
            batch = self.engine.get(pending.ref, pending.prompts, self._spec(step), group_ids)
            try:
                check_staleness(batch, self.version, self.config.run.max_staleness)
                break
            except ValueError as exc:
                self.num_stale_rejected += batch.num_samples
                log.warning("rejected a stale batch: %s", exc)
                pending = None
        self._prompts = [p for p in pending.prompts for _ in range(self.config.rollout.group_size)]
        metrics = {
            "time/rollout_s": time.perf_counter() - t0,
            "policy/version": self.version,
            "policy/batch_min_version": batch.min_policy_version(),
            "policy/staleness": self.version - batch.min_policy_version(),
            "rollout/stale_rejected_samples": self.num_stale_rejected,
            **_length_metrics(batch),
        }
        return batch, metrics

    def reward(self, batch: TrajectoryBatch, metrics: dict[str, Any]) -> TrajectoryBatch:
        t0 = time.perf_counter()
        responses = [s.response_ids.tolist() for s in batch.samples()]
        rewards = torch.tensor(
            ray.get(self.rewarder.score.remote(self._prompts, responses)), dtype=torch.float32
        )
        batch = batch.replace(rewards=rewards)
        validate(batch, vocab_size=self.config.model.vocab_size)
        metrics.update(
            {
                "time/reward_s": time.perf_counter() - t0,
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                "reward/max": float(rewards.max()),
            }
        )
        return batch

    def advantages(self, batch: TrajectoryBatch, metrics: dict[str, Any]) -> torch.Tensor:
        """Per-sample advantages; for DGO the sample weights exp(r/β)/mean_group exp(r/β)."""
        if self.config.algo.objective == "dgo":
            adv = dgo_weights(batch.rewards, batch.group_ids, dgo_beta=self.config.algo.dgo_beta)
        else:
            adv = self.advantage_fn(rewards=batch.rewards, group_ids=batch.group_ids)
        zv = zero_variance_groups(batch.rewards, batch.group_ids).metrics()
        metrics.update({f"advantage/{k}": float(v) for k, v in zv.items()})
        metrics["advantage/abs_mean"] = float(adv.abs().mean())
        return adv

    def old_logp(self, batch: TrajectoryBatch, advantages: torch.Tensor, metrics: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        metrics.update(
            ray.get(self.trainer.compute_old_logp.remote(batch, advantages), timeout=RAY_TIMEOUT_S)
        )
        metrics["time/old_logp_s"] = time.perf_counter() - t0

    def train(self, metrics: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        metrics.update(ray.get(self.trainer.train.remote(), timeout=RAY_TIMEOUT_S))
        metrics["time/train_s"] = time.perf_counter() - t0

    def sync_weights(self, version: int, metrics: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        out = self.engine.sync(version)
        self.version = version
        self.step_done = version - 1
        metrics.update({k if "/" in k else f"sync/{k}": v for k, v in out.items()})
        metrics["time/sync_s"] = time.perf_counter() - t0
        metrics["rollout/engine_restarts"] = self.engine.restarts

    def dump(self, step: int, batch: TrajectoryBatch) -> None:
        """Store the step's batch as trajectory shards (`logging.dump_trajectories`)."""
        if self.config.logging.dump_trajectories:
            folder = self.run_dir / "trajectories" / f"step_{step:06d}"
            write_shards([batch], folder, max_samples_per_shard=batch.num_samples, metadata={"step": step})

    def maybe_probe(self, step: int, metrics: dict[str, Any]) -> None:
        """Every `logging.diagnose_every` steps, right after a sync: the engine-vs-trainer mismatch
        at equal weights on fresh prompts (a stream of its own; never trained on)."""
        every = self.config.logging.diagnose_every
        if not every or (step + 1) % every:
            return
        if self._probe_source is None:
            self._probe_source = build_prompt_source(self.config)
            self._probe_source.rng.seed(self.config.run.seed + PROBE_SEED_OFFSET)
        prompts = self._probe_source.next_batch(
            self.config.rollout.batch_size // self.config.rollout.group_size
        )
        weights = self.trainer.export_weights.remote()
        metrics.update(ray.get(self.engine.actor.probe.remote(weights, prompts), timeout=RAY_TIMEOUT_S))

    # ------------------------------------------------------------------ offline (DGO)
    def offline_dataset(self) -> list[TrajectoryBatch]:
        """Stored trajectories (`data.trajectories`), or `data.offline_batches` rollout batches
        generated once with the starting policy and stored in `<run_dir>/offline_data`."""
        folder = self.config.data.trajectories
        if folder is None:
            folder = self.run_dir / "offline_data"
            if not (folder / "manifest.json").exists():
                batches = [
                    self.reward(*self.rollout(OFFLINE_STEP + i, None))
                    for i in range(self.config.data.offline_batches)
                ]
                write_shards(batches, folder, max_samples_per_shard=self.config.rollout.batch_size)
        data = TrajectoryBatch.concat(list(read_shards(folder, include_old_logp=False)))
        size = self.config.rollout.batch_size
        if data.num_samples < size:
            raise ValueError(
                f"data.trajectories={folder}: {data.num_samples} samples < rollout.batch_size={size}"
            )
        return [data.slice(i, i + size) for i in range(0, data.num_samples - size + 1, size)]

    def offline_batch(
        self, dataset: list[TrajectoryBatch], step: int
    ) -> tuple[TrajectoryBatch, dict[str, Any]]:
        """The step's slice of the stored data (epochs cycle over it)."""
        batch = dataset[step % len(dataset)]
        return batch, {
            "offline/epoch": step // len(dataset),
            "offline/reward_mean": float(batch.rewards.mean()),
            "policy/version": self.version,
            **_length_metrics(batch),
        }

    def evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        """Reward of fresh rollouts from the current policy (not trained on)."""
        batch, rollout_metrics = self.rollout(EVAL_STEP + step, None)
        batch = self.reward(batch, rollout_metrics)
        metrics.update({k: v for k, v in rollout_metrics.items() if k.startswith(("reward/", "time/"))})

    # ------------------------------------------------------------------ checkpoints
    def maybe_checkpoint(self, step: int) -> None:
        """Checkpoint after `step` every `run.checkpoint_every` steps (the last step is saved anyway)."""
        every = self.config.run.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.config.run.steps:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Trainer state + driver state after the last finished step (none finished: nothing)."""
        if self.step_done < 0:
            return
        step = self.step_done
        name = f"step_{step:06d}"
        ckpt = self.run_dir / "checkpoints" / name
        ckpt.mkdir(parents=True, exist_ok=True)
        ray.get(self.trainer.save_checkpoint.remote(str(ckpt / "trainer")), timeout=RAY_TIMEOUT_S)
        source = self._pending_state.get(step + 1, self.source.state())
        state = {
            "step": step,
            "version": self.version,
            "num_stale_rejected": self.num_stale_rejected,
            "source": _jsonable(source),
        }
        (ckpt / "driver.json").write_text(json.dumps(state))
        (self.run_dir / "checkpoints" / "latest").write_text(name)
        log.info("checkpoint %s", ckpt)

    def shutdown(self) -> None:
        for actor in (self.engine.actor, self.trainer, self.rewarder):
            if actor is not None:
                ray.kill(actor)


def _jsonable(state: dict) -> dict:
    version, internal, gauss = state["rng"]
    return {"rng": [version, list(internal), gauss], "order": state["order"]}


def _length_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    lengths = batch.response_lengths().float()
    stops = sum(r == "stop" for r in batch.finish_reasons)
    return {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/stop_share": stops / batch.num_samples,
        "rollout/samples": batch.num_samples,
        "rollout/tokens": int(lengths.sum()),
    }
