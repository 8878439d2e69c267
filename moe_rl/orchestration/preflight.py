"""The preflight: every component's rules on a recipe, asked in one place, before anything heavy.

Each rule lives with the component that enforces it at run time and is returned as `Rule`s:

* ``recipe``: the recipe's own consistency (values, model, batches, algorithm, data, ...) —
  `moe_rl.config.validate.recipe_rules`;
* ``reward``: the synthetic task against the model — `moe_rl.rewards.registry.reward_rules`;
* ``trainer``: parallel layout, batch packing, routing replay, objectives —
  `moe_rl.trainer.rules.trainer_rules`;
* ``engine``: what the rollout engine can return and run on the machine —
  `moe_rl.rollout.capabilities.engine_rules`;
* ``placement``: trainer ranks and engines against GPUs and nodes —
  `moe_rl.orchestration.placement.placement_rules`.

`preflight` returns them by component; `moe-rl plan` prints them, and `config check`, `submit`,
`diagnose` and `train` enforce them (`check`, `load_checked`), so all of them refuse the same
recipes with the same line. ``train`` also builds the run's inputs here (`build_inputs`: the
prompt stream, stored trajectories, the reward function or environment), so bad data fails in
seconds, and hands what it built to the run: nothing is built or read twice.

`config check`, `plan` and `submit` check against the machine the recipe describes
(`target_machine`); `train` and `diagnose`, which run the recipe here, against this machine
(`moe_rl.device.machine_here`), detected only once a rule needs it: a recipe with
``run.device=auto`` and no GPUs in its ``cluster`` section runs on the GPU of the machine it is
started on, and may use what that GPU can (nvfp4, say). Imports no torch itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.config.loader import load_recipe
from moe_rl.config.modes import RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.validate import recipe_rules
from moe_rl.device import Machine, RunDevice
from moe_rl.errors import ConfigError
from moe_rl.orchestration.placement import placement_rules
from moe_rl.rewards.registry import reward_rules
from moe_rl.rollout.capabilities import engine_rules
from moe_rl.rules import Rule
from moe_rl.trainer.rules import trainer_rules

log = logging.getLogger("moe_rl.preflight")

MachineSpec = Machine | Callable[[], Machine] | None
"""The machine a recipe is checked against: a `Machine`; a function that gives it, called only
when a rule needs it (detecting CUDA imports torch, which a recipe refused for its own
inconsistency should not wait for); or None for `target_machine`."""

COMPONENTS = ("recipe", "reward", "trainer", "engine", "placement")
"""The components asked, in order. The ones after ``recipe`` assume a consistent recipe."""

NOT_CHECKED = "not checked: the recipe itself is invalid"


def target_machine(config: RecipeConfig) -> Machine:
    """The machine a recipe is meant for: CUDA when ``run.device`` says so, or ``auto`` on a
    cluster with GPUs (``cluster.gpus_per_node > 0``); compute capability unknown."""
    device = config.run.device
    return Machine(
        cuda=device == RunDevice.CUDA or (device == RunDevice.AUTO and config.cluster.gpus_per_node > 0)
    )


@dataclass(frozen=True)
class Section:
    """One component's rules on a recipe."""

    component: str
    rules: tuple[Rule, ...]

    @property
    def broken(self) -> Rule | None:
        """The first rule that refuses the recipe (None: accepted)."""
        return next((rule for rule in self.rules if rule.broken), None)

    @property
    def warnings(self) -> list[Rule]:
        """Non-fatal rules that do not hold."""
        return [rule for rule in self.rules if not rule.fatal and not rule.ok]

    def error(self) -> str | None:
        """The line a refusal says: the recipe's and the rewards' own lines as they are (they name
        the field), the engine's prefixed by ``engine:``, the others' by component and rule name."""
        rule = self.broken
        if rule is None:
            return None
        if self.component in ("recipe", "reward"):
            return rule.detail
        if self.component == "engine":
            return f"engine: {rule.detail}"
        return f"{self.component}: {rule.message}"


def _machine(config: RecipeConfig, machine: MachineSpec) -> Callable[[], Machine]:
    @functools.cache
    def the_machine() -> Machine:
        if machine is None:
            return target_machine(config)
        return machine if isinstance(machine, Machine) else machine()

    return the_machine


def _components(config: RecipeConfig, machine: Callable[[], Machine]) -> dict[str, Callable[[], list[Rule]]]:
    return {
        "recipe": lambda: recipe_rules(config),
        "reward": lambda: reward_rules(config),
        "trainer": lambda: trainer_rules(config),
        "engine": lambda: engine_rules(config, machine()),
        "placement": lambda: placement_rules(config, machine()),
    }


def preflight(
    config: RecipeConfig, machine: MachineSpec = None, stop_at_first: bool = False
) -> list[Section]:
    """Every component's rules on ``config`` against ``machine`` (default: `target_machine`), in
    `COMPONENTS` order. A recipe that is not consistent in itself gets only its ``recipe`` section
    (the others assume it is). ``stop_at_first``: stop after the first section that refuses it, so
    a machine given as a function is not detected for a recipe refused before a rule needs it."""
    sections: list[Section] = []
    for component, rules in _components(config, _machine(config, machine)).items():
        section = Section(component, tuple(rules()))
        sections.append(section)
        if section.broken is not None and (stop_at_first or component == "recipe"):
            break
    return sections


def findings(config: RecipeConfig, machine: MachineSpec = None) -> dict[str, str | None]:
    """Per component, its refusal of ``config`` (None: accepted; `NOT_CHECKED` after a recipe that
    is not consistent in itself)."""
    found = {section.component: section.error() for section in preflight(config, machine)}
    return {component: found.get(component, NOT_CHECKED) for component in COMPONENTS}


def check(config: RecipeConfig, machine: MachineSpec = None) -> None:
    """Enforce every component's rules: raise `ConfigError` with the first refusal (the components
    after it are not asked); log the warnings of those asked."""
    for section in preflight(config, machine, stop_at_first=True):
        error = section.error()
        if error is not None:
            raise ConfigError(error)
        for rule in section.warnings:
            log.warning("%s", rule.detail)


def load_checked(
    recipe: str | Path, overrides: Sequence[str] = (), machine: MachineSpec = None
) -> RecipeConfig:
    """`load_recipe`, then `check`: a recipe every component accepts."""
    config = load_recipe(recipe, overrides)
    check(config, machine)
    return config


@dataclass
class RunInputs:
    """What a run reads before it starts anything heavy, built once by `build_inputs` and handed
    to the run: the prompt stream, the stored trajectories of an offline run (validated against
    the model), and the scorer of `data.reward` or the environment factory of `env.name`."""

    prompt_source: Any
    offline_data: Any = None
    scorer: Any = None
    env_factory: Any = None


def build_inputs(config: RecipeConfig) -> RunInputs:
    """Build the run's inputs (see `RunInputs`): every row of the prompt dataset, every stored
    trajectory of an offline run, the reward function's import or one environment are checked
    now, so bad data or a missing function is refused in seconds, naming the file, row or
    function."""
    from moe_rl.rewards.registry import build_prompt_source, build_scorer

    offline = None
    if config.run.mode == RunMode.OFFLINE and config.data.trajectories is not None:
        from moe_rl.orchestration.offline import read_offline

        offline = read_offline(config, Path(config.data.trajectories))
    source = build_prompt_source(config)  # offline runs draw evaluation prompts from it
    if config.env.name:  # the environment gives the rewards: import it and build one
        from moe_rl.envs.registry import build_env_factory

        return RunInputs(
            source, offline, env_factory=build_env_factory(config.env.name, dict(config.env.kwargs))
        )
    return RunInputs(source, offline, scorer=build_scorer(config))
