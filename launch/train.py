"""`moe-rl train`: resolve the recipe, prepare the run directory, run the RL loop."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from moe_rl.config import ConfigError, RecipeConfig, load_recipe, to_yaml
from moe_rl.device import hide_cuda_if_cpu

log = logging.getLogger("moe_rl.train")


def prepare_run_dir(config: RecipeConfig) -> Path:
    """Create `<output_dir>/<name>` and write the resolved recipe into it."""
    run_dir = Path(config.run.output_dir) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    return run_dir


def check_machine(config: RecipeConfig, machine=None) -> None:
    """Every component's checks again, against this machine (`load_recipe` checked them against
    the machine the recipe describes): a refusal is a `ConfigError` like any other bad recipe."""
    from moe_rl.device import Machine
    from moe_rl.validation import validate

    validate(config, machine or Machine.detect())


def train(recipe: str, overrides: Sequence[str] = (), resume: str | None = None) -> int:
    """Run the job of `recipe` (or continue the run directory `resume`); returns the exit code."""
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        config = load_recipe(run_dir / "config.yaml", overrides)
    else:
        config = load_recipe(recipe, overrides)
        run_dir = prepare_run_dir(config)
    log.info("recipe %s resolved and validated; run directory %s", recipe, run_dir)
    hide_cuda_if_cpu(config.run.device)  # before torch looks for CUDA
    check_machine(config)
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.driver import run

    setup_logging(config.logging.level)
    return run(config, run_dir, resume=resume is not None)
