"""The RL driver. It reads as the algorithm:

    generate → reward → advantages → old log-probs → train → sync weights → log / checkpoint

Modes (`run.mode`): `sync` (on-policy: each batch is generated with the weights it trains) and
`async` (one-step-off-policy: the next batch is generated while the current one trains; its
tokens are one policy version old, and batches older than `run.max_staleness` versions are
rejected and counted, never trained on). `trainer.num_mini_batches` > 1 takes several optimizer
steps per rollout batch (the off-policyness R2/R3 exist for).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import ray

from moe_rl.config.modes import RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.log import progress
from moe_rl.orchestration.actors import start_ray
from moe_rl.orchestration.metrics import MetricsSink, run_summary
from moe_rl.orchestration.preflight import RunInputs, build_inputs
from moe_rl.orchestration.stages import Stages
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
    stages = Stages(config, run_dir, inputs or build_inputs(config))
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


def online_loop(config: RecipeConfig, stages: Stages, start: int) -> Iterator[dict]:
    """Generate with the current policy (or one version behind, async), then train on it."""
    pending = stages.launch_rollout(start) if config.run.mode == RunMode.ASYNC else None
    for step in range(start, config.run.steps):
        t0 = time.perf_counter()
        batch, metrics = stages.rollout(step, pending)  # generate on the engine pool (+ staleness)
        batch = stages.reward(batch, metrics)  # verifiable rewards (scored by the reward worker)
        stages.dump(step, batch)  # optional trajectory shards
        advantages = stages.advantages(batch, metrics)  # GRPO / Dr.GRPO / RLOO
        prepared = stages.old_logp(batch, advantages, metrics)  # π_old + mismatch diagnostics
        if config.run.mode == RunMode.ASYNC and step + 1 < config.run.steps:
            pending = stages.launch_rollout(step + 1)  # overlaps training
        stages.train(prepared, metrics)  # objective + corrections
        stages.sync_weights(version=step + 1, metrics=metrics)  # quantized per recipe
        metrics["time/step_s"] = time.perf_counter() - t0
        stages.maybe_probe(step, metrics)  # optional mismatch probe
        yield {"step": step, **metrics}


def offline_loop(config: RecipeConfig, stages: Stages, start: int) -> Iterator[dict]:
    """DGO: generation decoupled from optimization; epochs over stored trajectories."""
    dataset = stages.offline_dataset()  # stored, or generated once
    for step in range(start, config.run.steps):
        t0 = time.perf_counter()
        batch, metrics = stages.offline_batch(dataset, step)
        weights = stages.advantages(batch, metrics)  # exp(r/β) / mean_group exp(r/β)
        prepared = stages.old_logp(batch, weights, metrics)  # drift from the sampling policy
        stages.train(prepared, metrics)  # −w·log π(y|x)
        stages.sync_weights(version=step + 1, metrics=metrics)
        stages.evaluate(step, metrics)  # fresh rollouts: reward/mean
        metrics["time/step_s"] = time.perf_counter() - t0
        yield {"step": step, **metrics}
