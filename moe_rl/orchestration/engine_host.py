"""One rollout engine replica's process, wherever it runs: a Ray actor of the engine pool
(`moe_rl.orchestration.actors.EngineActor`) or the one-process loop (`moe_rl.orchestration.local`).
Imports no Ray."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from moe_rl.config.modes import Engine
from moe_rl.config.run_plan import RunPlan
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.faults import FaultPoint, Faults
from moe_rl.weight_sync.protocol import (
    SyncMessage,
    SyncTarget,
    TransferCall,
    TransferReceiver,
    WeightReceiver,
)

if TYPE_CHECKING:
    from moe_rl.weight_sync.buckets import Bucket


class EngineHost:
    """One rollout engine replica's process, wherever it runs (a Ray actor, `EngineActor`, or the
    one-process loop): the engine, its rollout loop (single- or multi-turn), the weight receivers
    a sync fills (`SyncTarget`: the engine, or the probe's reference model) and the probe."""

    def __init__(
        self, config: RecipeConfig, plan: RunPlan, model_path: str | None, replica: int, env_factory=None,
        faults: Faults | None = None,
    ):  # fmt: skip
        """``plan``: the run's plan, decided by the process that started the run; ``env_factory``: the
        environment maker the preflight built (`env.name`; built here when not given); ``faults``:
        the faults planned for this process (`moe_rl.orchestration.faults`; None: none)."""
        self.config, self.replica = config, replica
        self.engine = make_engine(config, plan, model_path)
        from moe_rl.envs.rollout import rollouts_for

        self.rollouts = rollouts_for(config, self.engine, env_factory)  # single- or multi-turn (`env.name`)
        self._reference = None
        self.faults = faults
        from moe_rl.weight_sync.broadcast import StreamThreads

        self._streams = StreamThreads()

    def generate(self, prompts: Sequence[Any], sampling, group_ids: Sequence[int]):
        """``(batch, status)`` for `moe_rl.rewards.tasks.Prompt` s (the status with the environment's
        counts of a multi-turn rollout)."""
        if self.faults is not None:
            self.faults.reached(FaultPoint.GENERATE)
        batch, env = self.rollouts.generate(prompts, sampling, group_ids)
        return batch, {"replica": self.replica, "samples": batch.num_samples, "env": env}

    def begin_weight_update(self, version: int, into: SyncTarget = SyncTarget.ENGINE) -> None:
        self._target(into).begin_weight_update(version)

    def receive(self, message: SyncMessage, into: SyncTarget = SyncTarget.ENGINE) -> dict[str, float]:
        """A message of a sync for ``into`` (`moe_rl.weight_sync.protocol.SyncMessage`): a bucket,
        which the receiver loads; one of vLLM's transfer calls, which only an engine on vLLM's
        transfer routes takes; or a sender's `BroadcastStream`, whose buckets this process takes in a
        thread of its own while other senders' streams and buckets arrive (trainer ranks send at once,
        and may wait on each other's collectives), each loaded under one lock; the sync's finish
        waits for every stream."""
        from moe_rl.weight_sync.broadcast import BroadcastStream

        if isinstance(message, BroadcastStream):
            self._streams.start(message, functools.partial(self._land, into=into))
            return {"bytes": 0.0}
        with self._streams.lock:
            return self._land(message, into)

    def _land(self, message: Bucket | TransferCall, into: SyncTarget) -> dict[str, float]:
        if self.faults is not None:
            self.faults.reached(FaultPoint.SYNC)
        target = self._target(into)
        if not isinstance(message, TransferCall):
            return target.receive_bucket(message)
        if not isinstance(target, TransferReceiver):
            raise TypeError(
                f"the {SyncTarget(into)} of this engine process ({type(target).__name__}) takes buckets, "
                f"not vLLM's weight transfer; it was sent {message.method}"
            )
        target.receive_transfer(message)
        return {"bytes": 0.0}

    def finish_weight_update(self, version: int, into: SyncTarget = SyncTarget.ENGINE) -> dict[str, float]:
        self._streams.wait()  # every sender's stream has ended (or its error is raised here)
        return self._target(into).finish_weight_update(version)

    def sleep(self, level: int) -> dict[str, float]:
        """The engine gives its memory back while the trainer works (colocated; `cluster.release_memory`)."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict[str, float]:
        return self.engine.wake_up()

    def _target(self, into: SyncTarget) -> WeightReceiver:
        """The receiver a sync fills: the engine, or the probe's reference model (built once)."""
        if SyncTarget(into) == SyncTarget.ENGINE:
            return self.engine
        if self._reference is None:
            from moe_rl.diagnostics.probe import ReferenceModel

            self._reference = ReferenceModel(self.config)
        return self._reference

    def probe(self, prompts) -> dict[str, float | str]:
        """The zero-update mismatch probe (`moe_rl.diagnostics.probe`): the engine as it is now vs
        the full-precision reference model, which the last reference sync filled."""
        from moe_rl.diagnostics.probe import mismatch_probe

        return mismatch_probe(self.engine, self._target(SyncTarget.REFERENCE).model, prompts, self.config)


def make_engine(config: RecipeConfig, plan: RunPlan, model_path: str | None = None):
    """The engine of `rollout.engine`, after the capability checks for this machine; a vLLM engine
    takes its weights by ``plan``'s sync route and sleeps when it releases memory."""
    from moe_rl.rollout.capabilities import check_recipe

    check_recipe(config)
    if config.rollout.engine == Engine.MEGATRON:
        from moe_rl.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(config)
    from moe_rl.rollout.vllm_engine import VLLMEngine

    if model_path is None:
        raise ValueError("rollout.engine=vllm starts from a Hugging Face folder; none was written")
    return VLLMEngine.from_recipe(config, model_path, plan)
