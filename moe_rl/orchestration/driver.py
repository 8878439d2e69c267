"""The RL driver of `moe-rl train`: Ray started (or joined), the workers placed
(`moe_rl.orchestration.workers`), the loop of `moe_rl.orchestration.loop` run step after step with
metrics, checkpoints and stop signals, and a summary of the run at its end.
`trainer.num_mini_batches` > 1 takes several optimizer steps per rollout batch (the off-policyness
R2/R3 exist for).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray

from moe_rl.config.schema import RecipeConfig
from moe_rl.log import progress
from moe_rl.orchestration.metrics import MetricsSink, run_summary
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.ray_cluster import start_ray
from moe_rl.orchestration.run import Run
from moe_rl.orchestration.stages import Waiting
from moe_rl.orchestration.workers import ray_workers
from moe_rl.run_dir import Resume, read_metrics, sealed

log = logging.getLogger("moe_rl.driver")


STOP_GRACE_S = 5.0
"""After a stop request, how long the driver still waits for a phase running the user's code (the
reward worker's scoring: `moe_rl.orchestration.stages.Waiting`) before it stops without it."""


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM (`scancel`, preemption): the first signal lets the current step
    finish, so the checkpoint holds trainer and driver state of the same step; a second one stops
    at once, without a checkpoint (the run then resumes from the previous one). A phase running the
    user's code that has not ended `STOP_GRACE_S` after the first signal (a reward function that
    hangs) is not waited for longer: the run stops, saying what it waited for (`given_up`)."""

    def __init__(self) -> None:
        self.requested = False
        self.waiting: Callable[[], Waiting | None] = lambda: None
        """What the driver waits for now (`Stages.waiting`)."""
        self.given_up: str | None = None
        """What the run stopped waiting for."""

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"signal {signum} again")
        self.requested = True
        phase = self.waiting()
        more = f"; {phase.what}: waiting {STOP_GRACE_S:g} s more" if phase is not None else ""
        log.warning(
            "signal %d: finishing this step, then saving a checkpoint (again to stop now)%s", signum, more
        )
        if phase is not None:
            timer = threading.Timer(STOP_GRACE_S, self._give_up, (phase,))
            timer.daemon = True
            timer.start()

    def _give_up(self, phase: Waiting) -> None:
        """`STOP_GRACE_S` after the first signal: still waiting for ``phase``, stop waiting (the
        main thread gets the signal again, as from a second Ctrl-C)."""
        if self.waiting() is not phase:
            return
        self.given_up = f"{phase.what}, for {time.monotonic() - phase.since:.0f} s"
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # wakes a blocked wait too


def run(config: RecipeConfig, run_dir: Path, inputs: RunInputs, resume: Resume | None = None) -> int:
    """Train `config` in `run_dir`, or continue it from where ``resume`` says; returns the exit code
    (0 done, 130 interrupted). ``inputs``: what the preflight read
    (`moe_rl.orchestration.preflight.run_inputs`). A summary of the run (rewards, mismatch,
    checkpoints, what to run next) ends it, stopped or not."""
    t0 = time.monotonic()
    with contextlib.ExitStack() as running:  # what started is shut down at the end, however it ends
        job, sink, start = start_run(config, run_dir, resume, inputs, running)
        stop = StopRequest()
        stop.install()
        stop.waiting = lambda: job.stages.waiting
        try:
            code = train_steps(config, job, sink, stop, start)
        except KeyboardInterrupt:
            waited = f" while waiting for {stop.given_up}" if stop.given_up else " at once"
            log.warning("stopped%s: no checkpoint of this step; --resume starts from the last one", waited)
            code = 130
    records = read_metrics(run_dir) if sink.path.exists() else []
    log.info("%s", run_summary(records, config.run.steps, time.monotonic() - t0, run_dir, sealed(run_dir)))
    return code


def start_run(
    config: RecipeConfig, run_dir: Path, resume: Resume | None, inputs: RunInputs,
    running: contextlib.ExitStack,
) -> tuple[Run, MetricsSink, int]:  # fmt: skip
    """Ray (started here, or joined), the workers, the engines at the starting weights, and the first
    step: 0, or the one after the checkpoint ``resume`` continues from. A Ctrl-C or SIGTERM meanwhile
    stops at once (there is nothing to save yet); ``running`` shuts down what started, Ray's
    processes included, even when it stopped half-way."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C, until `StopRequest`
    try:
        if not ray.is_initialized():
            running.callback(ray.shutdown, wait_for_processes=True)
        start_ray(config, run_dir / "logs")
        job = Run(config, run_dir, ray_workers(config, run_dir, inputs), inputs)
        running.callback(job.shutdown)
        sink = MetricsSink(run_dir, config.logging.tensorboard, config.logging.wandb_project, config.run.name)
        running.callback(sink.close)
        start = job.restore(sink, resume.checkpoint) if resume else job.start()
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            "interrupted while the run started (Ray, its workers), before its first step"
        ) from None
    return job, sink, start


def train_steps(config: RecipeConfig, job: Run, sink: MetricsSink, stop: StopRequest, start: int) -> int:
    """The steps from ``start`` (0, or the one after the checkpoint resumed) to `run.steps` or a stop
    request (`Run.steps`: each step's record is logged before its checkpoint is written)."""
    with progress(config.logging.progress) as bar:
        task = bar.add_task("RL steps", total=config.run.steps, completed=start, info="")
        for record in job.steps(start):
            record = sink.log(record.pop("step"), record)
            bar.update(task, advance=1, info=f"reward {record.get('reward/mean', 0):.3f}")
            if stop.requested:
                job.checkpoint()
                log.warning("stopped after step %d; continue with --resume %s", record["step"], job.folder)
                return 130
    return 0
