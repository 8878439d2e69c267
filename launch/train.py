"""`moe-rl train`: resolve the recipe, prepare the run directory, run the RL loop."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

from moe_rl.config import ConfigError, RecipeConfig, load_recipe, to_yaml

log = logging.getLogger("moe_rl.train")

# Each stage of the loop and the module that implements it.
STAGES = (
    ("trajectory format", "moe_rl.data.trajectory"),
    ("objectives and corrections", "moe_rl.algo.objectives"),
    ("rollout engines", "moe_rl.rollout.engine"),
    ("Megatron trainer", "moe_rl.trainer.worker"),
    ("rewards", "moe_rl.rewards.registry"),
    ("RL driver", "moe_rl.orchestration.driver"),
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def prepare_run_dir(config: RecipeConfig) -> Path:
    """Create `<output_dir>/<name>` and write the resolved recipe into it."""
    run_dir = Path(config.run.output_dir) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    return run_dir


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
    missing = [stage for stage, module in STAGES if not _has_module(module)]
    log.info("recipe %s resolved and validated; run directory %s", recipe, run_dir)
    if missing:
        log.warning("not built yet: %s. Nothing was trained.", ", ".join(missing))
        return 0
    from moe_rl.log import setup_logging

    setup_logging(config.logging.level)
    driver = importlib.import_module("moe_rl.orchestration.driver")
    return driver.run(config, run_dir, resume=resume is not None)
