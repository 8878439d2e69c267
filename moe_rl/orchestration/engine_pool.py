"""The engine pool: ``rollout.num_engines`` rollout engine replicas.

* Generation: a step's prompts are dispatched by token load (`batches.dispatch`; the ``n`` samples
  of a prompt stay on one replica); each replica's batch stays in the object store; the reward
  worker merges them in prompt order.
* A replica whose process dies (during generation or a weight sync) is restarted alone with the
  current weights, at most ``MAX_ENGINE_RESTARTS`` times per replica; only its prompts are
  generated again, the other replicas' results are kept.
* Weight sync: every replica is told a sync begins, the trainer group streams its buckets to all
  of them (each bucket published once), then each replica takes the new version when its last
  bucket has landed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.config.derived import max_response_tokens
from moe_rl.config.modes import Engine
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.actors import RAY_TIMEOUT_S, EngineActor
from moe_rl.orchestration.batches import Dispatch, dispatch
from moe_rl.orchestration.placement import Placement
from moe_rl.orchestration.trainer_group import PLACEMENT_TIMEOUT_S, TrainerGroup
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec

log = logging.getLogger("moe_rl.driver")

MAX_ENGINE_RESTARTS = 2
REPLICA_SEED_STRIDE = 1_000_003
"""Replica r samples with the step's seed + r · stride (one replica: the step's seed)."""


@dataclass
class Replica:
    index: int
    actor: Any = None
    pg: Any = None
    restarts: int = 0


@dataclass
class Generation:
    """A generation in flight: per replica its prompts and ``(batch ref, status ref)``."""

    plan: Dispatch
    prompts: list[Prompt]
    spec: SamplingSpec
    group_ids: list[int]
    refs: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per replica, what its ``generate`` reported (samples, environment counts)."""


class EnginePool:
    """Engine replicas (see the module docstring)."""

    def __init__(
        self,
        config: RecipeConfig,
        trainer: TrainerGroup,
        run_dir: Path,
        placement: Placement,
        env_factory=None,
    ):
        self.config, self.trainer, self.run_dir, self.placement = config, trainer, Path(run_dir), placement
        self.env_factory = env_factory
        self.replicas = [Replica(r) for r in range(placement.engines)]
        self.version = 0
        self.quantized_wire = False
        self._hf_folder: str | None = None
        self.regenerated_prompts = 0

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    # ------------------------------------------------------------------ lifecycle
    def spawn(self) -> None:
        """Start every replica not started yet, without waiting for it. A replica that starts from
        the trainer's Hugging Face export (vLLM) is not started here: the trainer group must have
        formed first (`start` starts it)."""
        if self.config.rollout.engine != Engine.VLLM:
            self._spawn_missing()

    def start(self, version: int) -> dict[str, float]:
        """Start the replicas not started yet (`spawn`) and sync them to ``version``."""
        self._spawn_missing()
        caps = ray.get(self.replicas[0].actor.capabilities.remote(), timeout=RAY_TIMEOUT_S)
        self.quantized_wire = caps.quantized_wire
        return self.sync(version)

    def _spawn_missing(self) -> None:
        for replica in self.replicas:
            if replica.actor is None:
                self._spawn(replica)

    def _spawn(self, replica: Replica) -> None:
        model_path = None
        if self.config.rollout.engine == Engine.VLLM:
            if self._hf_folder is None:
                self._hf_folder = self.trainer.save_hf(str(self.run_dir / "hf_start"))
            model_path = self._hf_folder
        colocated = self.config.cluster.rollout_nodes == 0
        replica.pg = placement_group([self.placement.engine_bundle(colocated)], strategy="PACK")
        if not ray.get(replica.pg.ready(), timeout=PLACEMENT_TIMEOUT_S):
            raise RuntimeError(f"no room for engine replica {replica.index}")
        threads = self.placement.threads("engine", os.cpu_count() or 1)
        replica.actor = (
            ray.remote(EngineActor)
            .options(
                num_cpus=0, num_gpus=self.placement.engine_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(replica.pg, placement_group_bundle_index=0),
            )
            .remote(self.config, model_path, replica.index, threads, replica.restarts, self.env_factory)
        )  # fmt: skip

    def _restart(self, replica: Replica, error: Exception, version: int) -> None:
        replica.restarts += 1
        if replica.restarts > MAX_ENGINE_RESTARTS:
            raise RuntimeError(
                f"rollout engine replica {replica.index} died {replica.restarts} times; last error: {error}"
            ) from error
        log.error("engine replica %d died (%s); restarting it with the current weights", replica.index, error)
        self._kill(replica)
        self._spawn(replica)
        self._sync_replicas([replica], version)

    def _kill(self, replica: Replica) -> None:
        if replica.actor is not None:
            ray.kill(replica.actor)
        if replica.pg is not None:
            remove_placement_group(replica.pg)
        replica.actor = replica.pg = None

    def shutdown(self) -> None:
        for replica in self.replicas:
            self._kill(replica)

    # ------------------------------------------------------------------ weights
    def sync(self, version: int) -> dict[str, float]:
        """Stream the trainer's weights to every replica as ``version``; restart replicas that die."""
        start = time.perf_counter()
        out = self._sync_replicas(self.replicas, version)
        self.version = version
        out["sync/seconds"] = time.perf_counter() - start
        return out

    def _sync_replicas(self, replicas: list[Replica], version: int) -> dict[str, float]:
        begun = []
        for replica in replicas:
            try:
                ray.get(replica.actor.begin_weight_update.remote(version), timeout=RAY_TIMEOUT_S)
                begun.append(replica)
            except ray.exceptions.RayActorError as exc:
                self._restart(replica, exc, version)  # comes back with these weights
        if not begun:
            return {}
        streamed = self.trainer.stream_weights([r.actor for r in begun], self.quantized_wire)
        dead = {begun[i].index for i in streamed["dead"]}
        finished: dict = {}
        for replica in begun:
            if replica.index in dead:
                continue
            try:
                finished = ray.get(replica.actor.finish_weight_update.remote(version), timeout=RAY_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                dead.add(replica.index)
        for replica in begun:
            if replica.index in dead:
                self._restart(replica, RuntimeError("the process died during a weight sync"), version)
        metrics = {k: v for k, v in finished.items() if isinstance(v, (int, float, str))}
        if streamed["report"] is not None:
            metrics.update(streamed["report"].summary())
        metrics.update(
            {
                "sync/bytes": streamed["bytes"],
                "sync/in_place_bytes": streamed["in_place"],
                "sync/buckets": streamed["buckets"],
                "sync/senders": streamed["senders"],
                "sync/shared_memory": streamed["shared_memory"],
            }
        )
        return metrics

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], spec: SamplingSpec, group_ids: list[int]) -> Generation:
        """Dispatch ``prompts`` over the replicas and start generating (returns at once)."""
        response = max_response_tokens(self.config)
        plan = dispatch([len(p.ids) for p in prompts], spec.n, response, len(self.replicas))
        gen = Generation(plan, prompts, spec, group_ids)
        for replica in self.replicas:
            self._launch(gen, replica)
        return gen

    def _launch(self, gen: Generation, replica: Replica) -> None:
        mine = gen.plan.assignment[replica.index]
        if not mine:
            return
        seed = None if gen.spec.seed is None else gen.spec.seed + replica.index * REPLICA_SEED_STRIDE
        gen.refs[replica.index] = replica.actor.generate.remote(
            [gen.prompts[i] for i in mine], replace(gen.spec, seed=seed), [gen.group_ids[i] for i in mine]
        )

    def collect(self, gen: Generation) -> list[Any]:
        """The replicas' batch refs (replica order, the empty ones left out); a replica that died
        is restarted with the current weights and generates its prompts again."""
        for replica in self.replicas:
            while replica.index in gen.refs:
                try:
                    gen.statuses[replica.index] = ray.get(gen.refs[replica.index][1], timeout=RAY_TIMEOUT_S)
                    break
                except ray.exceptions.RayActorError as exc:
                    self._restart(replica, exc, self.version)
                    self.regenerated_prompts += len(gen.plan.assignment[replica.index])
                    self._launch(gen, replica)
                except ray.exceptions.GetTimeoutError as exc:
                    raise RuntimeError(
                        f"engine replica {replica.index} did not answer within {RAY_TIMEOUT_S:.0f} s"
                    ) from exc
        return [gen.refs[r][0] for r in sorted(gen.refs)]

    def probe(self, prompts) -> dict[str, float | str]:
        """The mismatch probe on replica 0: its reference model gets the trainer's weights at full
        precision through the same bucket stream, then the engine is measured against it."""
        actor = self.replicas[0].actor
        ray.get(actor.begin_weight_update.remote(self.version, "reference"), timeout=RAY_TIMEOUT_S)
        self.trainer.stream_weights([actor], quantized_wire=False, into="reference")
        ray.get(actor.finish_weight_update.remote(self.version, "reference"), timeout=RAY_TIMEOUT_S)
        return ray.get(actor.probe.remote(prompts), timeout=RAY_TIMEOUT_S)
