"""The RL loop in one process, without Ray: one trainer rank and the Megatron engine side by side.

For machines without Ray (the GPU check runs RL steps this way) and for tests that need the
one-rank run as a reference. It is not a second copy of the loop: it runs the loop of
`moe_rl.orchestration.loop` over the same `Stages` as `moe-rl train`, with in-process handles for
the workers (`LocalTrainer`, `LocalEngines`, the reward worker's `Rewarder`) where the Ray run has
actors; weights travel through the same weight-sync coordinator and rank sender, in-process. On CPU
it reproduces the Ray run of the same recipe with one rank and one engine exactly. Trainer layouts
other than one whole-model rank need the Ray trainer group.

    python -m moe_rl.orchestration.local [--force-new] RECIPE [overrides...]   # one JSON line a step

As a command it writes its run directory as `moe-rl train` does (`main`).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
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

    def __init__(self, config: RecipeConfig, inputs: RunInputs | None = None, run_dir: Path | None = None):
        """``run_dir``: the run's directory, taken already (`main`): its checkpoints, at the recipe's
        `run.checkpoint_every` and after the last step, and the offline data a run generates; None:
        a run that saves nothing (an offline run then needs its data given: `data.trajectories`, or
        `moe-rl sft`'s demonstrations)."""
        from moe_rl.orchestration.stages import Stages, Workers

        if config.parallel.trainer_world_size != 1 or config.rollout.engine != Engine.MEGATRON:
            raise ValueError(
                f"the in-process loop runs one trainer rank and the Megatron engine; got "
                f"parallel.trainer_world_size={config.parallel.trainer_world_size}, "
                f"rollout.engine={config.rollout.engine} (use `moe-rl train`, on Ray)"
            )
        self.config, self.run_dir = config, run_dir
        inputs = inputs or build_inputs(config)
        self.trainer = LocalTrainer(config)  # first, as in a one-rank run: the trainer's seed
        workers = Workers(
            self.trainer, LocalEngines(config, inputs.env_factory), Rewarder(config, inputs.scorer)
        )
        self.stages = Stages(config, run_dir, workers, inputs)
        self.stages.start()

    def step(self, step: int) -> dict[str, Any]:
        """The run's step ``step`` (`loop.run_loop`: online, or offline for ``run.mode=offline``)."""
        from moe_rl.orchestration.loop import run_loop

        (record,) = run_loop(self.config, self.stages, step, step + 1)
        return record

    def run(self, steps: int | None = None) -> Iterator[dict[str, Any]]:
        """The run's steps up to ``steps`` (default `run.steps`), each record once its step is done;
        with a run directory, checkpointed as `moe-rl train` does (the last step's at the end)."""
        from moe_rl.orchestration.loop import run_loop

        for record in run_loop(
            self.config, self.stages, 0, self.config.run.steps if steps is None else steps
        ):
            if self.run_dir is not None:
                self.stages.maybe_checkpoint(record["step"])
            yield record
        if self.run_dir is not None:
            self.stages.checkpoint()


USAGE = "usage: python -m moe_rl.orchestration.local [--force-new] RECIPE [overrides...]\n"


def main(argv: list[str] | None = None) -> int:
    """Run ``RECIPE`` with ``overrides`` in this process, in its run directory (`run.output_dir` /
    `run.name`, taken as `moe-rl train` takes it: one that holds a run is refused, unless
    ``--force-new`` starts it over): its recipe, its metrics, its checkpoints; one JSON record a step
    on stdout. A user's mistake is one line on stderr and exit code 2."""
    from moe_rl.config.loader import to_yaml
    from moe_rl.errors import user_error_of
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.metrics import MetricsSink
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.run_dir import RunLock, take_new

    args = list(sys.argv[1:] if argv is None else argv)
    force_new = args[:1] == ["--force-new"]
    args = args[force_new:]
    if not args or args[0].startswith("-"):
        sys.stderr.write(USAGE)
        return 2
    try:
        config = load_checked(args[0], args[1:])
        setup_logging(config.logging.level)
        run_dir = Path(config.run.output_dir) / config.run.name
        with RunLock(run_dir):
            take_new(run_dir, to_yaml(config), force_new, starts_from=config.model.init_from)
            sink = MetricsSink(
                run_dir, config.logging.tensorboard, config.logging.wandb_project, config.run.name
            )
            try:
                for record in LocalRun(config, run_dir=run_dir).run():
                    record = sink.log(record.pop("step"), record)
                    sys.stdout.write(json.dumps(record) + "\n")
                    sys.stdout.flush()
            finally:
                sink.close()
    except Exception as exc:
        user = user_error_of(exc)
        if user is None:
            raise
        sys.stderr.write(f"error: {user}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
