"""`moe-rl train`: resolve the recipe, prepare the run directory, run the RL loop."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

from moe_rl.config import RecipeConfig, load_recipe, to_yaml

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
    """Run the job of `recipe`; returns the process exit code."""
    config = load_recipe((resume and Path(resume) / "config.yaml") or recipe, overrides)
    missing = [stage for stage, module in STAGES if not _has_module(module)]
    run_dir = prepare_run_dir(config)
    log.info("recipe %s resolved and validated; run directory %s", recipe, run_dir)
    if missing:
        log.warning("not built yet: %s. Nothing was trained.", ", ".join(missing))
        built = [stage for stage, _ in STAGES if stage not in missing]
        log.info("built: %s", ", ".join(built) or "configuration only")
        return 0
    driver = importlib.import_module("moe_rl.orchestration.driver")
    return driver.run(config, run_dir, resume=resume is not None)
