"""The engine pool: ``rollout.num_engines`` rollout engine replicas.

* Generation: a step's prompts are dispatched by token load (`moe_rl.orchestration.dispatch`; the
  ``n`` samples of a prompt stay on one replica); each replica's batch stays in the object store;
  the reward worker merges them in prompt order.
* A replica whose process dies (during generation, a weight sync or a memory phase) is restarted
  alone, at most ``MAX_ENGINE_RESTARTS`` times per replica, and named in the pool's answer
  (`moe_rl.orchestration.replicas`): the caller brings it to the current weights
  (`moe_rl.weight_sync.coordinator.WeightSync`) before it generates again; only its prompts
  are generated again (`regenerate`), the other replicas' results are kept.
* Weight sync, the pool's part of it (`moe_rl.weight_sync.coordinator.WeightSync` runs a sync):
  every replica is told a sync begins (`begin`), the trainer group streams its buckets to the
  replicas' actors, then each replica takes the new version when its last bucket has landed
  (`finish`). The pool knows nothing of the trainer group."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import ray

from moe_rl.config.derived import PlacementMode, max_response_tokens
from moe_rl.config.modes import Engine
from moe_rl.config.run_plan import RunPlan
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.actors import RAY_TIMEOUT_S, SYNC_GROUP, EngineActor, sync_call
from moe_rl.orchestration.dispatch import Generation, dispatch
from moe_rl.orchestration.replicas import Answers, Replica
from moe_rl.orchestration.sampling import Draw, replica_spec
from moe_rl.orchestration.seats import Seats
from moe_rl.rewards.tasks import Prompt
from moe_rl.weight_sync.broadcast import StreamBroken
from moe_rl.weight_sync.coordinator import Begun, Finished
from moe_rl.weight_sync.protocol import SyncTarget

log = logging.getLogger("moe_rl.driver")

MAX_ENGINE_RESTARTS = 2


class EnginePool:
    """Engine replicas (see the module docstring)."""

    replicas: list[Replica]

    def __init__(
        self, config: RecipeConfig, seats: Seats, plan: RunPlan, env_factory=None,
        start_folder: Callable[[], str] | None = None,
    ):  # fmt: skip
        """``seats``: where replicas sit (colocated on GPUs: in the trainer's bundles, which must be
        reserved first). ``plan``: the run's plan, which every replica follows. ``env_factory``: the
        environment maker the preflight built (multi-turn). ``start_folder``: gives the Hugging Face
        folder replicas that start from one (vLLM) load."""
        self.config, self.seats, self.placement, self.plan = config, seats, seats.placement, plan
        self.env_factory, self.start_folder = env_factory, start_folder
        self.replicas = [Replica(r) for r in range(seats.placement.engines)]
        self._hf_folder: str | None = None

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

    def start(self) -> None:
        """Start the replicas not started yet (`spawn`); the first sync follows (it waits for them)."""
        self._spawn_missing()

    def _spawn_missing(self) -> None:
        for replica in self.replicas:
            if replica.actor is None:
                self._spawn(replica)

    def _spawn(self, replica: Replica) -> None:
        model_path = None
        if self.config.rollout.engine == Engine.VLLM:
            if self._hf_folder is None:
                if self.start_folder is None:
                    raise ValueError("rollout.engine=vllm starts from a Hugging Face folder; none was given")
                self._hf_folder = self.start_folder()
            model_path = self._hf_folder
        colocated = self.placement.mode == PlacementMode.COLOCATED
        options = self.seats.engine_options(replica.index, colocated)
        groups = {SYNC_GROUP: 1} if self.config.rollout.inflight_updates else None  # syncs beside generation
        threads = self.placement.threads("engine", os.cpu_count() or 1)
        replica.actor = (
            (ray.remote(concurrency_groups=groups)(EngineActor) if groups else ray.remote(EngineActor))
            .options(**options)
            .remote(
                self.config, self.plan, model_path, replica.index, threads, replica.restarts, self.env_factory,
                self.seats.visible_gpus(replica.index),
            )
        )  # fmt: skip

    def _restart(self, replica: Replica, error: Exception) -> None:
        """A new process for ``replica``, without weights (the caller brings it to them)."""
        replica.restarts += 1
        if replica.restarts > MAX_ENGINE_RESTARTS:
            raise RuntimeError(
                f"rollout engine replica {replica.index} died {replica.restarts} times; last error: {error}"
            ) from error
        log.error("engine replica %d died (%s); restarting it with the current weights", replica.index, error)
        self._kill(replica)
        self._spawn(replica)

    def _kill(self, replica: Replica) -> None:
        if replica.actor is not None:
            ray.kill(replica.actor)
        self.seats.release_engine(replica.index)
        replica.actor = None

    def shutdown(self) -> None:
        for replica in self.replicas:
            self._kill(replica)

    # ------------------------------------------------------------------ weights
    def begin(self, version: int, replicas: list[Replica], target: SyncTarget) -> Begun:
        """Tell ``replicas`` a sync of ``version`` into ``target`` begins; a replica that died is
        restarted and named in the answer, not told."""
        begun = Begun([])
        for replica in replicas:
            try:
                ray.get(
                    sync_call(replica.actor, "begin_weight_update", self.config).remote(version, target),
                    timeout=RAY_TIMEOUT_S,
                )
                begun.began.append(replica)
            except ray.exceptions.RayActorError as exc:
                self._restart(replica, exc)
                begun.restarted.append(replica)
        return begun

    def finish(self, version: int, replicas: list[Replica], dead: set[int], target: SyncTarget) -> Finished:
        """Each replica that took the whole sync takes ``version``; the ones that died on the way
        are restarted; live ones whose weight stream broke (a process of the stream's group died:
        `StreamBroken`) are named as cut off. Both take the sync again (the coordinator's loop)."""
        finished = Finished()
        dead = set(dead)
        for replica in replicas:
            if replica.index in dead:
                continue
            try:
                finished.received = ray.get(
                    sync_call(replica.actor, "finish_weight_update", self.config).remote(version, target),
                    timeout=RAY_TIMEOUT_S,
                )
            except ray.exceptions.RayActorError:
                dead.add(replica.index)
            except StreamBroken as exc:  # Ray's error of the engine's task: its cause, without the traceback
                finished.cut_off.append(replica)
                finished.error = getattr(exc, "cause", None) or exc
        for replica in replicas:
            if replica.index in dead:
                self._restart(replica, RuntimeError("the process died during a weight sync"))
                finished.restarted.append(replica)
        return finished

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], draw: Draw, group_ids: list[int]) -> Generation:
        """Dispatch ``prompts`` over the replicas and start generating them for ``draw`` (returns
        at once)."""
        response = max_response_tokens(self.config)
        n = self.config.rollout.group_size
        plan = dispatch([len(p.ids) for p in prompts], n, response, len(self.replicas))
        gen = Generation(plan, prompts, draw, group_ids)
        for replica in self.replicas:
            self._launch(gen, replica)
        return gen

    def _launch(self, gen: Generation, replica: Replica) -> None:
        prompts, group_ids = gen.part(replica.index)
        if prompts:
            spec = replica_spec(self.config, gen.draw, replica.index)
            gen.refs[replica.index] = replica.actor.generate.remote(prompts, spec, group_ids)

    def collect(self, gen: Generation) -> list[Replica]:
        """Wait for each replica's part of ``gen``. A replica whose process died is restarted and
        returned at once, its prompts not generated yet: bring it to the current weights, then
        `regenerate` them and collect again. Empty once every part has come (`Generation.batch_refs`)."""
        for replica in self.replicas:
            if replica.index not in gen.refs or replica.index in gen.statuses:
                continue
            try:
                gen.statuses[replica.index] = ray.get(gen.refs[replica.index][1], timeout=RAY_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                self._restart(replica, exc)
                return [replica]
            except ray.exceptions.GetTimeoutError as exc:
                raise RuntimeError(
                    f"engine replica {replica.index} did not answer within {RAY_TIMEOUT_S:.0f} s"
                ) from exc
        return []

    def regenerate(self, gen: Generation, replicas: list[Replica]) -> None:
        """The prompts of ``replicas`` (restarted, at the current weights) generated again."""
        for replica in replicas:
            self._launch(gen, replica)

    # ------------------------------------------------------------------ memory between phases
    def sleep(self, replicas: list[Replica] | None = None) -> Answers:
        """Every replica (or ``replicas``) gives its memory back while the trainer works
        (colocated, `cluster.release_memory`); the most one keeps resident."""
        return self._each("sleep", replicas, self.config.cluster.engine_sleep_level)

    def wake_up(self) -> Answers:
        """Every replica takes its memory again before it generates; the most one holds."""
        return self._each("wake_up", None)

    def _each(self, method: str, replicas: list[Replica] | None, *args: Any) -> Answers:
        """``method`` on each replica; one whose process died is restarted (a new process, awake,
        without weights) and named in the answer."""
        answers, restarted = [], []
        for replica in self.replicas if replicas is None else replicas:
            try:
                answers.append(ray.get(getattr(replica.actor, method).remote(*args), timeout=RAY_TIMEOUT_S))
            except ray.exceptions.RayActorError as exc:
                self._restart(replica, exc)
                restarted.append(replica)
        keys = {key for answer in answers for key in answer}
        return Answers({key: max(a.get(key, 0.0) for a in answers) for key in keys}, restarted)

    def probe(self, prompts) -> dict[str, float | str]:
        """The mismatch probe on replica 0, whose reference model the last reference sync filled:
        the engine is measured against it."""
        return ray.get(self.replicas[0].actor.probe.remote(prompts), timeout=RAY_TIMEOUT_S)
