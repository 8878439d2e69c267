"""`moe-rl train`: resolve the recipe, run the preflight, take the run directory, build the inputs,
run the RL loop. A Ctrl-C before the run's first step stops it at once with one line, and a new
run leaves no half-made run directory behind (`moe_rl.run_dir.unclaim`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.config import ConfigError, RecipeConfig, load_recipe, to_yaml
from moe_rl.device import machine_here
from moe_rl.errors import UserError, user_error_of
from moe_rl.log import close_log_file
from moe_rl.run_dir import Resume, RunLock, newest_usable, take_new, unclaim

if TYPE_CHECKING:
    from moe_rl.orchestration.preflight import RunInputs

log = logging.getLogger("moe_rl.train")
LOG_FILE = "logs/train.log"
"""The driver's log in the run directory: every message, and the full traceback of an error."""


def check_machine(config: RecipeConfig, machine=None, paths: bool = True) -> RunInputs | None:
    """Every component's rules (`moe_rl.orchestration.preflight.check`), against the machine the
    run runs on (default: `here`): a refusal is a `ConfigError` like any other bad recipe."""
    from moe_rl.orchestration.preflight import check

    return check(config, machine or here(config), paths)


def here(config: RecipeConfig):
    """This machine as a run of ``config`` sees it (`machine_here`, which hides the GPUs from a
    run.device=cpu run before torch looks for CUDA), detected only when a rule needs it."""
    return lambda: machine_here(config.run.device)


def train(
    recipe: str, overrides: Sequence[str] = (), resume: str | None = None, force_new: bool = False,
    log_level: str | None = None, sft: bool = False,
) -> int:  # fmt: skip
    """Run the job of `recipe` (or continue the run directory `resume`); returns the exit code.
    The run directory is locked for the run's life; one that already holds a run is refused unless
    it is resumed or ``force_new`` starts it over. ``log_level`` (`--log-level`) replaces
    `logging.level` for this invocation."""
    if resume and force_new:
        raise ConfigError("--resume continues a run and --force-new starts it over: give one of them")
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        config = load_recipe(run_dir / "config.yaml", overrides)
    else:
        if sft:  # `moe-rl sft`: the recipe as a supervised run on demonstrations
            from moe_rl.orchestration.sft import sft_overrides

            overrides = sft_overrides(recipe, overrides)
        config = load_recipe(recipe, overrides)
        run_dir = Path(config.run.output_dir) / config.run.name
    inputs = _preflight(config)
    made = not os.path.lexists(run_dir)
    with RunLock(run_dir):
        try:
            if not resume:
                take_new(run_dir, to_yaml(config), force_new, starts_from=config.model.init_from)
            if log_level:
                config = replace(config, logging=replace(config.logging, level=log_level.upper()))
            log.info("recipe %s resolved and validated; run directory %s", recipe, run_dir)
            return _run(config, run_dir, resume is not None, inputs)
        except KeyboardInterrupt as exc:  # one at the run's steps is the driver's (it saves, then returns)
            if made:
                close_log_file(run_dir / LOG_FILE)  # the folder goes
            left = f"--resume {run_dir} continues it" if resume else unclaim(run_dir, made)
            raise KeyboardInterrupt(f"{str(exc) or 'interrupted while the run started'}; {left}") from None


def _preflight(config: RecipeConfig) -> RunInputs:
    """Every rule and every input read and checked once, before the run directory is touched
    (`moe_rl.orchestration.preflight.run_inputs`)."""
    from moe_rl.orchestration.preflight import run_inputs

    try:
        return run_inputs(config, here(config))
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            "interrupted during the preflight (the recipe's rules and inputs): nothing was started or written"
        ) from None


def _run(config: RecipeConfig, run_dir: Path, resume: bool, inputs: RunInputs) -> int:
    """The run, with the terminal kept for the project's messages: library messages and warnings go
    to `logs/` only (`moe_rl.log`) unless `logging.verbose` or level DEBUG shows them. A resume's
    checkpoint is chosen here, before anything starts (`moe_rl.run_dir.newest_usable`)."""
    from moe_rl.log import log_to_file, route_library_logs, setup_logging, shows_libraries

    setup_logging(
        config.logging.level, quiet=not shows_libraries(config.logging.level, config.logging.verbose)
    )
    trace = log_to_file(run_dir / LOG_FILE)
    try:
        point = Resume(newest_usable(run_dir)) if resume else None
        from moe_rl.orchestration.driver import run  # imports Ray, which adds a log handler of its own

        route_library_logs()
        return run(config, run_dir, resume=point, inputs=inputs)
    except Exception as exc:
        user = user_error_of(exc)
        if user is None:
            raise
        trace.exception("the run stopped on bad input")  # the full traceback, in the log file only
        raise UserError(f"{user} (traceback: {run_dir / LOG_FILE})") from None
