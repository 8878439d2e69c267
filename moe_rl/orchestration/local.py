"""The RL loop in one process, without Ray: one trainer rank and the Megatron engine side by side.

For machines without Ray (the GPU check runs RL steps this way) and for tests that need the
one-rank run as a reference. It is not a second copy of the loop: it runs the loop of
`moe_rl.orchestration.loop` over the same `Stages` as `moe-rl train`, with in-process handles for
the workers (`LocalTrainer`, `LocalEngines`, the reward worker's `Rewarder`) where the Ray run has
actors; weights travel through the same weight-sync coordinator and rank sender, in-process. On CPU
it reproduces the Ray run of the same recipe with one rank and one engine exactly. Trainer layouts
other than one whole-model rank need the Ray trainer group.

    python -m moe_rl.orchestration.local RECIPE [overrides...]   # prints one JSON line per step
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from moe_rl.config.derived import max_response_tokens
from moe_rl.config.modes import Engine
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.batches import Rewarder
from moe_rl.orchestration.dispatch import Generation, dispatch
from moe_rl.orchestration.preflight import RunInputs, build_inputs
from moe_rl.orchestration.rank_parts import BatchHandle, RankPart
from moe_rl.orchestration.replicas import Answers, Begun, Finished, Replica
from moe_rl.orchestration.sampling import Draw, replica_spec
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport

log = logging.getLogger("moe_rl.local")

SYNC_TIMEOUT_S = 1800.0


class LocalTrainer:
    """One whole-model trainer rank in this process, behind the trainer group's interface."""

    dp_size = world_size = 1

    def __init__(self, config: RecipeConfig):
        from moe_rl.config.sync_plan import sync_plan
        from moe_rl.trainer.worker import TrainerWorker
        from moe_rl.weight_sync.sender import RankSender

        self.config = config
        self.worker = TrainerWorker(config)
        plan = sync_plan(config, next(self.worker.model.parameters()).device.type, in_process=True)
        self.sender = RankSender(
            self.worker.model, config.quant, config.model.num_layers, plan, lora=config.lora
        )
        self._handles = itertools.count(1)
        self._prepared: dict[int, Any] = {}

    @property
    def model(self):
        return self.worker.model

    def old_logp(self, parts: Sequence[RankPart]) -> BatchHandle:
        from moe_rl.trainer.batch import TrainerBatch

        (part,) = parts
        prepared = self.worker.old_logp(
            TrainerBatch.of_share(part.trajectories, part.advantages, part.share, part.zvp_signs)
        )
        handle = next(self._handles)
        self._prepared = {handle: prepared}
        return BatchHandle(handle, prepared.metrics)

    def train(self, prepared: BatchHandle) -> dict[str, float]:
        return self.worker.train(self._prepared.pop(prepared.handle))

    def stream_weights(self, engines: Sequence[Any], target: SyncTarget, whole: bool = True) -> SyncReport:
        """The rank's tensors to ``target`` of each engine in this process, bucket by bucket."""
        from moe_rl.weight_sync.transport import Receiver

        receivers = {
            i: Receiver(functools.partial(engine.receive_bucket, into=target))
            for i, engine in enumerate(engines)
        }
        with self.worker.weights_resident():  # parameters released for a generation come back for it
            reference = SyncTarget(target) == SyncTarget.REFERENCE
            return self.sender.send(receivers, reference, SYNC_TIMEOUT_S, whole)

    def release_memory(self, params: bool) -> dict[str, float]:
        return self.worker.release_memory(params)

    def restore_memory(self) -> dict[str, float]:
        return self.worker.restore_memory()

    def save_hf(self, directory: str) -> str:
        from moe_rl.megatron.hf_weights import save_hf_checkpoint
        from moe_rl.megatron.model import model_config_to_hf_config

        save_hf_checkpoint(self.worker.model, directory, model_config_to_hf_config(self.config.model))
        return directory

    def save_checkpoint(self, directory: str) -> None:
        self.worker.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        return self.worker.load_checkpoint(directory)

    def shutdown(self) -> None:
        self.sender.close()


class LocalEngines:
    """One Megatron engine in this process, behind the engine pool's interface."""

    def __init__(self, config: RecipeConfig, env_factory=None):
        from moe_rl.orchestration.engine_host import EngineHost

        self.config = config
        self.host = EngineHost(config, None, 0, env_factory=env_factory)
        self.replicas = [Replica(0, actor=self.host)]
        self.restarts = 0  # one process: nothing dies apart

    def spawn(self) -> None:
        return None

    def start(self) -> None:
        return None

    def generate(self, prompts: list, draw: Draw, group_ids: list[int]) -> Generation:
        n = self.config.rollout.group_size
        plan = dispatch([len(p.ids) for p in prompts], n, max_response_tokens(self.config), 1)
        gen = Generation(plan, prompts, draw, group_ids)
        batch, status = self.host.generate(prompts, replica_spec(self.config, draw, 0), group_ids)
        gen.refs[0], gen.statuses[0] = (batch, status), status
        return gen

    def collect(self, gen: Generation) -> list[Replica]:
        return []  # generated already; no replica restarted

    def begin(self, version: int, replicas: list[Replica], target: SyncTarget) -> Begun:
        for replica in replicas:
            replica.actor.begin_weight_update(version, target)
        return Begun(replicas)

    def finish(self, version: int, replicas: list[Replica], dead: set[int], target: SyncTarget) -> Finished:
        finished = Finished()
        for replica in replicas:
            finished.received = replica.actor.finish_weight_update(version, target)
        return finished

    def probe(self, prompts) -> dict[str, float | str]:
        return self.host.probe(prompts)

    def sleep(self, replicas: list[Replica] | None = None) -> Answers:
        return Answers(self.host.sleep(self.config.cluster.engine_sleep_level))

    def wake_up(self) -> Answers:
        return Answers(self.host.wake_up())

    def shutdown(self) -> None:
        return None


class LocalRun:
    """The loop of `moe-rl train` in this process (see the module docstring)."""

    def __init__(self, config: RecipeConfig, inputs: RunInputs | None = None):
        from moe_rl.orchestration.stages import Stages, Workers

        if config.parallel.trainer_world_size != 1 or config.rollout.engine != Engine.MEGATRON:
            raise ValueError(
                f"the in-process loop runs one trainer rank and the Megatron engine; got "
                f"parallel.trainer_world_size={config.parallel.trainer_world_size}, "
                f"rollout.engine={config.rollout.engine} (use `moe-rl train`, on Ray)"
            )
        self.config = config
        inputs = inputs or build_inputs(config)
        self.trainer = LocalTrainer(config)  # first, as in a one-rank run: the trainer's seed
        workers = Workers(
            self.trainer, LocalEngines(config, inputs.env_factory), Rewarder(config, inputs.scorer)
        )
        self.stages = Stages(config, None, workers, inputs)
        self.stages.start()

    def step(self, step: int) -> dict[str, Any]:
        """generate → reward → advantages → old log-probs → train → sync, for step ``step``."""
        from moe_rl.orchestration.loop import online_loop

        return next(online_loop(self.config, self.stages, step, step + 1))

    def run(self, steps: int | None = None) -> Iterator[dict[str, Any]]:
        from moe_rl.orchestration.loop import online_loop

        yield from online_loop(self.config, self.stages, 0, self.config.run.steps if steps is None else steps)


def main(argv: list[str] | None = None) -> int:
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.preflight import load_checked

    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stderr.write("usage: python -m moe_rl.orchestration.local RECIPE [overrides...]\n")
        return 2
    config = load_checked(args[0], args[1:])
    setup_logging(config.logging.level)
    for record in LocalRun(config).run():
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
