"""The one validation entry: every component's own checks of a recipe, called in one place.

Each rule lives with the component that enforces it at run time:

* ``recipe``: the recipe's own consistency (types, choices, batch shapes) — `moe_rl.config.validate`;
* ``trainer``: parallel layout, batch packing, routing replay, objectives — `moe_rl.trainer.rules`;
* ``engine``: what the rollout engine can return and run on the device — `moe_rl.rollout.capabilities`;
* ``placement``: trainer ranks and engines against GPUs and nodes — `moe_rl.orchestration.placement`.

`load_recipe` runs them all, so `config check`, `plan`, `submit`, `diagnose` and `train` refuse
the same recipes before anything heavy loads. `config check`, `plan` and `submit` check against
the machine the recipe describes (`target_machine`); `train` and `diagnose`, which run the recipe
here, against this machine (`moe_rl.device.machine_here`), detected only once a rule needs it: a
recipe with ``run.device=auto`` and no GPUs in its ``cluster`` section runs on the GPU of the
machine it is started on, and may use what that GPU can (nvfp4, say). Imports no torch itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from moe_rl.config.loader import ConfigError
from moe_rl.config.schema import RecipeConfig
from moe_rl.device import Machine


@dataclass(frozen=True)
class Rule:
    """One constraint on a recipe: whether it holds, and the values behind it."""

    name: str
    ok: bool
    detail: str


def first_broken(rules: Iterable[Rule]) -> None:
    """Raise ``ValueError`` naming the first rule that does not hold."""
    for rule in rules:
        if not rule.ok:
            raise ValueError(f"{rule.name}: {rule.detail}")


def target_machine(config: RecipeConfig) -> Machine:
    """The machine a recipe is meant for: CUDA when ``run.device`` says so, or ``auto`` on a
    cluster with GPUs (``cluster.gpus_per_node > 0``); compute capability unknown."""
    device = config.run.device
    return Machine(cuda=device == "cuda" or (device == "auto" and config.cluster.gpus_per_node > 0))


MachineSpec = Machine | Callable[[], Machine] | None
"""The machine a recipe is checked against: a `Machine`; a function that gives it, called only
when a check needs it (detecting CUDA imports torch, which a recipe refused for its own
inconsistency should not wait for); or None for `target_machine`."""


def _checks(config: RecipeConfig, machine: MachineSpec) -> dict[str, Callable[[RecipeConfig], None]]:
    from moe_rl.config.validate import validate_recipe
    from moe_rl.orchestration.placement import check_placement
    from moe_rl.rollout.capabilities import check_recipe
    from moe_rl.trainer.rules import check_trainer

    @functools.cache
    def the_machine() -> Machine:
        if machine is None:
            return target_machine(config)
        return machine if isinstance(machine, Machine) else machine()

    return {
        "recipe": validate_recipe,
        "trainer": check_trainer,
        "engine": lambda config: check_recipe(config, the_machine()),
        "placement": lambda config: check_placement(config, the_machine()),
    }


def _error(check: Callable[[RecipeConfig], None], config: RecipeConfig) -> str | None:
    try:
        check(config)
    except (ValueError, ConfigError) as exc:
        return str(exc)
    return None


def findings(config: RecipeConfig, machine: MachineSpec = None) -> dict[str, str | None]:
    """Per component, its first error on ``config`` (None: accepted), against ``machine``
    (default: `target_machine`)."""
    out: dict[str, str | None] = {}
    for component, check in _checks(config, machine).items():
        if out.get("recipe"):  # the others assume a consistent recipe
            out[component] = "not checked: the recipe itself is invalid"
            continue
        out[component] = _error(check, config)
    return out


def validate(config: RecipeConfig, machine: MachineSpec = None) -> None:
    """Raise `ConfigError` with the first component's error (the components after it are not
    checked, so a machine given as a function is not detected for a recipe refused before)."""
    for component, check in _checks(config, machine).items():
        error = _error(check, config)
        if error is not None:
            raise ConfigError(f"{error}" if component == "recipe" else f"{component}: {error}")
