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
from moe_rl.config.run_plan import RunPlan, run_plan
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.device import Machine, resolve_device
from moe_rl.orchestration.batches import Rewarder
from moe_rl.orchestration.dispatch import Generation, dispatch
from moe_rl.orchestration.preflight import RunInputs, build_inputs
from moe_rl.orchestration.rank_parts import BatchHandle, RankPart
from moe_rl.orchestration.replicas import Answers, Replica
from moe_rl.orchestration.sampling import Draw, replica_spec
from moe_rl.orchestration.stages import Stages
from moe_rl.weight_sync.coordinator import Begun, Finished
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport

log = logging.getLogger("moe_rl.local")

SYNC_TIMEOUT_S = 1800.0


class LocalTrainer:
    """One whole-model trainer rank in this process (`moe_rl.orchestration.handles.TrainerHandle`)."""

    dp_size = world_size = 1

    def __init__(self, config: RecipeConfig, sync: SyncPlan):
        from moe_rl.orchestration.trainer_host import TrainerHost

        self.host = TrainerHost(config, sync)
        self._handles = itertools.count(1)

    @property
    def model(self):
        return self.host.model

    def old_logp(self, parts: Sequence[RankPart]) -> BatchHandle:
        (part,) = parts
        handle = next(self._handles)
        return BatchHandle(handle, self.host.old_logp(part.trajectories, part, handle))

    def train(self, prepared: BatchHandle) -> dict[str, float]:
        return self.host.train(prepared.handle)

    def stream_weights(self, engines: Sequence[Any], target: SyncTarget, whole: bool = True) -> SyncReport:
        """The rank's tensors to ``target`` of each engine in this process, bucket by bucket."""
        from moe_rl.weight_sync.transport import Receiver

        receivers = {
            i: Receiver(functools.partial(engine.receive, into=target)) for i, engine in enumerate(engines)
        }
        return self.host.send(receivers, target, SYNC_TIMEOUT_S, whole)

    def release_memory(self, params: bool) -> dict[str, float]:
        return self.host.release_memory(params)

    def restore_memory(self) -> dict[str, float]:
        return self.host.restore_memory()

    def save_hf(self, directory: str) -> str:
        return self.host.save_hf(directory)

    def save_checkpoint(self, directory: str) -> None:
        self.host.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        return self.host.load_checkpoint(directory)

    def shutdown(self) -> None:
        self.host.close()


class LocalEngines:
    """One Megatron engine in this process (`moe_rl.orchestration.handles.EnginesHandle`)."""

    replicas: list[Replica]

    def __init__(self, config: RecipeConfig, plan: RunPlan, env_factory=None):
        from moe_rl.orchestration.engine_host import EngineHost

        self.config = config
        self.host = EngineHost(config, plan, None, 0, env_factory)
        self.replicas = [Replica(0, actor=self.host)]

    @property
    def restarts(self) -> int:
        """Nothing dies apart in one process."""
        return 0

    def start(self) -> None:
        return None

    def generate(self, prompts: list, draw: Draw, group_ids: list[int]) -> Generation:
        n = self.config.rollout.group_size
        plan = dispatch([len(p.ids) for p in prompts], n, max_response_tokens(self.config), 1)
        gen = Generation(plan, prompts, draw, group_ids)
        self.regenerate(gen, self.replicas)
        return gen

    def collect(self, gen: Generation) -> list[Replica]:
        return []  # generated already; no replica restarted

    def regenerate(self, gen: Generation, replicas: list[Replica]) -> None:
        """Generate ``gen``'s prompts (of the one replica) now."""
        for replica in replicas:
            prompts, group_ids = gen.part(replica.index)
            spec = replica_spec(self.config, gen.draw, replica.index)
            batch, status = replica.actor.generate(prompts, spec, group_ids)
            gen.refs[replica.index], gen.statuses[replica.index] = (batch, status), status

    def begin(self, version: int, replicas: list[Replica], target: SyncTarget) -> Begun:
        for replica in replicas:
            replica.actor.begin_weight_update(version, target)
        return Begun(replicas)

    def finish(self, version: int, replicas: list[Replica], dead: set[int], target: SyncTarget) -> Finished:
        finished = Finished()
        for replica in replicas:
            finished.received = replica.actor.finish_weight_update(version, target)
        return finished

    def probe(self, prompts: list) -> dict[str, float | str]:
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
        """``inputs``: what the preflight read (`moe_rl.orchestration.preflight.run_inputs`; None: a
        caller that ran no preflight, built here). ``run_dir``: the run's directory, taken already
        (`main`): its checkpoints, at the recipe's `run.checkpoint_every` and after the last step, and
        the offline data a run generates; None: a run that saves nothing (an offline run then needs
        its data given: `data.trajectories`, or `moe-rl sft`'s demonstrations)."""
        from moe_rl.orchestration.handles import Workers
        from moe_rl.orchestration.run import Run

        if config.parallel.trainer_world_size != 1 or config.rollout.engine != Engine.MEGATRON:
            raise ValueError(
                f"the in-process loop runs one trainer rank and the Megatron engine; got "
                f"parallel.trainer_world_size={config.parallel.trainer_world_size}, "
                f"rollout.engine={config.rollout.engine} (use `moe-rl train`, on Ray)"
            )
        self.config, self.run_dir = config, run_dir
        inputs = build_inputs(config) if inputs is None else inputs
        plan = run_plan(config, resolve_device(config.run.device, Machine.detect()), in_process=True)
        self.trainer = LocalTrainer(config, plan.sync)  # first, as in a one-rank run: the trainer's seed
        engines = LocalEngines(config, plan, inputs.env_factory)
        workers = Workers(self.trainer, engines, Rewarder(config, inputs.scorer), plan)
        self.job = Run(config, run_dir, workers, inputs)
        self.job.start()

    @property
    def stages(self) -> Stages:
        """The run's stages (the job's)."""
        return self.job.stages

    def step(self, step: int) -> dict[str, Any]:
        """The run's step ``step`` (`loop.run_loop`: online, or offline for ``run.mode=offline``)."""
        from moe_rl.orchestration.loop import run_loop

        (record,) = run_loop(self.config, self.stages, self.job.offline, step, step + 1)
        return record

    def run(self, steps: int | None = None) -> Iterator[dict[str, Any]]:
        """The run's steps up to ``steps`` (default `run.steps`), each record once its step is done;
        with a run directory, checkpointed as `moe-rl train` does (`Run.steps`: the last step's at
        the end)."""
        return self.job.steps(0, steps)


USAGE = "usage: python -m moe_rl.orchestration.local [--force-new] RECIPE [overrides...]\n"


def main(argv: list[str] | None = None) -> int:
    """Run ``RECIPE`` with ``overrides`` in this process, in its run directory (`run.output_dir` /
    `run.name`, taken as `moe-rl train` takes it: one that holds a run is refused, unless
    ``--force-new`` starts it over): its recipe, its metrics, its checkpoints; one JSON record a step
    on stdout. A user's mistake is one line on stderr and exit code 2."""
    from moe_rl.config.loader import load_recipe, to_yaml
    from moe_rl.device import machine_here
    from moe_rl.errors import user_error_of
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.metrics import MetricsSink
    from moe_rl.orchestration.preflight import run_inputs
    from moe_rl.run_dir import RunLock, take_new

    args = list(sys.argv[1:] if argv is None else argv)
    force_new = args[:1] == ["--force-new"]
    args = args[force_new:]
    if not args or args[0].startswith("-"):
        sys.stderr.write(USAGE)
        return 2
    try:
        config = load_recipe(args[0], args[1:])
        inputs = run_inputs(
            config, lambda: machine_here(config.run.device)
        )  # read once, before anything starts
        setup_logging(config.logging.level)
        run_dir = Path(config.run.output_dir) / config.run.name
        with RunLock(run_dir):
            take_new(run_dir, to_yaml(config), force_new, starts_from=config.model.init_from)
            sink = MetricsSink(
                run_dir, config.logging.tensorboard, config.logging.wandb_project, config.run.name
            )
            try:
                for record in LocalRun(config, inputs, run_dir).run():
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
