"""A run around its steps: started, or restored from a checkpoint; its steps (`moe_rl.orchestration.
loop.run_loop` over its `moe_rl.orchestration.stages.Stages`), checkpointed at the recipe's cadence
and after the last; its offline data; its workers shut down at the end. `moe-rl train`
(`moe_rl.orchestration.driver`) and the one-process loop (`moe_rl.orchestration.local`) both run one.
Imports no Ray."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe_rl import run_dir
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.handles import Workers
from moe_rl.orchestration.loop import run_loop
from moe_rl.orchestration.offline import OfflineData
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.run_state import RunState
from moe_rl.orchestration.stages import Stages

log = logging.getLogger("moe_rl.driver")


class Run:
    """A run's steps between its start and its end (see the module docstring)."""

    def __init__(self, config: RecipeConfig, folder: Path | None, workers: Workers, inputs: RunInputs):
        """``folder``: the run directory, where checkpoints, dumps and generated offline data go
        (None: a run that writes none of them)."""
        self.config, self.folder = config, None if folder is None else Path(folder)
        self.workers = workers
        self.stages = Stages(config, self.folder, workers, inputs)
        self.offline = OfflineData(config, self.folder, inputs.offline_data, workers.rewarder)

    # ------------------------------------------------------------------ start / resume
    def start(self) -> int:
        """The engines started and at the starting weights; the first step, 0."""
        self.workers.engines.start()
        self.stages.sync.run(self.stages.state.version)
        return 0

    def restore(self, sink, usable: run_dir.Usable | None) -> int:
        """Continue from ``usable``, the newest complete, intact checkpoint (`run_dir.newest_usable`,
        chosen before the run started; None: none was sealed, so from step 0); metrics and the
        checkpoints after it are dropped or set aside only once it has loaded. The first step."""
        folder = self.folder / "checkpoints"
        if usable is None:  # e.g. a Slurm job requeued before its first checkpoint, a full disk in it
            log.warning("--resume %s: no checkpoint yet; starting from step 0", self.folder)
            start = self.start()
            run_dir.set_aside_newer(folder, -1)  # saves that never finished
            sink.resume_from(0)
            return start
        state, source = RunState.from_json(json.loads((usable.path / "driver.json").read_text()))
        self.workers.trainer.load_checkpoint(str(usable.path / "trainer"))
        self.stages.source.load_state(source)
        self.stages.state = state
        self.workers.engines.start()
        self.stages.sync.run(state.version)
        run_dir.set_aside_newer(folder, state.step_done)
        sink.resume_from(state.step_done + 1)
        log.info(
            "resumed from %s at step %d (policy version %d)", usable.path, state.step_done + 1, state.version
        )
        return state.step_done + 1

    # ------------------------------------------------------------------ steps
    def steps(self, start: int, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """The records of steps ``start`` to ``stop`` (default `run.steps`), each once its step is
        done; once the caller has taken a record, its step is checkpointed when the cadence says so
        (`maybe_checkpoint`), and the last step after the loop. A caller that stops early saves with
        `checkpoint`."""
        for record in run_loop(self.config, self.stages, self.offline, start, stop):
            step = record["step"]  # the caller may take it out of the record
            yield record
            self.maybe_checkpoint(step)
        self.checkpoint()

    # ------------------------------------------------------------------ checkpoints
    def maybe_checkpoint(self, step: int) -> None:
        """Checkpoint after `step` every `run.checkpoint_every` steps (the last step is saved anyway)."""
        every = self.config.run.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.config.run.steps:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Trainer state + the run's state (`RunState`) after the last finished step (none
        finished, or no run directory: nothing), sealed by a manifest written last
        (`run_dir.write_manifest`)."""
        state = self.stages.state
        if state.step_done < 0 or self.folder is None:
            return
        run_dir.ensure_owned(self.folder)  # this run still holds its directory
        name = f"step_{state.step_done:06d}"
        folder = self.folder / "checkpoints"
        ckpt = folder / name
        if run_dir.verify(ckpt) is None:  # this step is saved already (a stop right after a checkpoint)
            return
        with run_dir.writing(ckpt, f"checkpoint {name}"):  # a full disk: one line naming it
            (ckpt / run_dir.MANIFEST).unlink(missing_ok=True)  # not complete until sealed again
            ckpt.mkdir(parents=True, exist_ok=True)
            self.workers.trainer.save_checkpoint(str(ckpt / "trainer"))
            (ckpt / "driver.json").write_text(json.dumps(state.to_json(self.stages.source.state())))
            run_dir.write_manifest(ckpt)
            run_dir.mark_latest(folder, name)
        log.info("checkpoint %s", ckpt)

    def shutdown(self) -> None:
        self.workers.shutdown()
