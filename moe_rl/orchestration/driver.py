"""The RL driver of `moe-rl train`: Ray started (or joined), the workers placed
(`moe_rl.orchestration.workers`), the loop of `moe_rl.orchestration.loop` run step after step with
metrics, checkpoints and stop signals, and a summary of the run at its end.
`trainer.num_mini_batches` > 1 takes several optimizer steps per rollout batch (the off-policyness
R2/R3 exist for).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import ray

from moe_rl.config.modes import RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.log import progress
from moe_rl.orchestration.actors import start_ray
from moe_rl.orchestration.loop import offline_loop, online_loop
from moe_rl.orchestration.metrics import MetricsSink, run_summary
from moe_rl.orchestration.preflight import RunInputs, build_inputs
from moe_rl.orchestration.stages import Stages
from moe_rl.orchestration.workers import ray_workers
from moe_rl.run_dir import read_metrics, sealed

log = logging.getLogger("moe_rl.driver")


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM (`scancel`, preemption): the first signal lets the current step
    finish, so the checkpoint holds trainer and driver state of the same step; a second one stops
    at once, without a checkpoint (the run then resumes from the previous one)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"signal {signum} again")
        self.requested = True
        log.warning("signal %d: finishing this step, then saving a checkpoint (again to stop now)", signum)


def run(config: RecipeConfig, run_dir: Path, resume: bool = False, inputs: RunInputs | None = None) -> int:
    """Train `config` in `run_dir`; returns the exit code (0 done, 130 interrupted). ``inputs``:
    what the preflight built (`moe_rl.orchestration.preflight.build_inputs`; built here when not
    given). A summary of the run (rewards, mismatch, checkpoints, what to run next) ends it,
    stopped or not."""
    t0 = time.monotonic()
    started = start_ray(config, run_dir / "logs")
    stop = StopRequest()
    stop.install()
    inputs = inputs or build_inputs(config)
    stages = Stages(config, run_dir, ray_workers(config, run_dir, inputs), inputs)
    sink = MetricsSink(run_dir, config.logging.tensorboard, config.logging.wandb_project, config.run.name)
    try:
        code = train_steps(config, stages, sink, stop, resume)
    except KeyboardInterrupt:
        log.warning("stopped at once: no checkpoint of this step; --resume starts from the last one")
        code = 130
    finally:
        sink.close()
        stages.shutdown()
        if started:
            ray.shutdown()
    records = read_metrics(run_dir) if sink.path.exists() else []
    log.info("%s", run_summary(records, config.run.steps, time.monotonic() - t0, run_dir, sealed(run_dir)))
    return code


def train_steps(
    config: RecipeConfig, stages: Stages, sink: MetricsSink, stop: StopRequest, resume: bool
) -> int:
    """The steps from the start (or the checkpoint resumed) to `run.steps` or a stop request."""
    start = stages.restore(sink) if resume else stages.start()
    loop = offline_loop if config.run.mode == RunMode.OFFLINE else online_loop
    with progress(config.logging.progress) as bar:
        task = bar.add_task("RL steps", total=config.run.steps, completed=start, info="")
        for record in loop(config, stages, start):
            record = sink.log(record.pop("step"), record)
            stages.maybe_checkpoint(record["step"])
            bar.update(task, advance=1, info=f"reward {record.get('reward/mean', 0):.3f}")
            if stop.requested:
                stages.checkpoint()
                log.warning(
                    "stopped after step %d; continue with --resume %s", record["step"], stages.run_dir
                )
                return 130
    stages.checkpoint()
    return 0
