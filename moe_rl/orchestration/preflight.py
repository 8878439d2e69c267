"""The preflight: every component's rules on a recipe, asked in one place, before anything heavy.

Each rule lives with the component that enforces it at run time and is returned as `Rule`s:

* ``recipe``: the recipe's own consistency (values, model, batches, algorithm, data, ...) —
  `moe_rl.config.validate.recipe_rules`;
* ``inputs``: the files a run reads exist, as this machine sees them (the dataset, stored
  trajectories, the model checkpoint and its architecture) — `input_rules`; ``paths=False``
  (``--skip-path-checks``) leaves them to the machines that run the job;
* ``reward``: the synthetic task against the model — `moe_rl.rewards.registry.reward_rules`;
* ``trainer``: parallel layout, batch packing, routing replay, objectives —
  `moe_rl.trainer.rules.trainer_rules`;
* ``engine``: what the rollout engine can return and run on the machine —
  `moe_rl.rollout.capabilities.engine_rules`;
* ``placement``: trainer ranks and engines against GPUs and nodes —
  `moe_rl.orchestration.placement.placement_rules`.

`preflight` returns them by component; `moe-rl plan` prints them, and `config check`, `submit`,
`diagnose` and `train` enforce them (`check`, `load_checked`), so all of them refuse the same
recipes with the same line. The preflight also reads what a user gave as the run will read it
(`build_inputs`: the prompt stream, stored trajectories, the reward function or environment), so bad
data fails in seconds, and returns what it read (`Preflight.inputs`); a run that starts here takes
its inputs from `run_inputs`, so nothing is built or read twice.

`config check`, `plan` and `submit` check against the machine the recipe describes
(`target_machine`); `train` and `diagnose`, which run the recipe here, against this machine
(`moe_rl.device.machine_here`), detected only once a rule needs it: a recipe with
``run.device=auto`` and no GPUs in its ``cluster`` section runs on the GPU of the machine it is
started on, and may use what that GPU can (nvfp4, say). Imports no torch itself.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.config.derived import target_device
from moe_rl.config.loader import load_recipe
from moe_rl.config.modes import Attention, Family, RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.validate import recipe_rules
from moe_rl.device import Machine
from moe_rl.errors import BRIEF_CHARS, ConfigError, UserError, clip, user_error_of
from moe_rl.megatron.rules import checkpoint_rule
from moe_rl.orchestration.placement import placement_rules
from moe_rl.rewards.registry import reward_rules
from moe_rl.rollout.capabilities import engine_rules
from moe_rl.rules import Rule
from moe_rl.trainer.rules import trainer_rules

if TYPE_CHECKING:
    from moe_rl.data.trajectory import TrajectoryBatch
    from moe_rl.envs.base import Environment
    from moe_rl.rewards.datasets import PromptSource
    from moe_rl.rewards.registry import RewardScorer

log = logging.getLogger("moe_rl.preflight")

MachineSpec = Machine | Callable[[], Machine] | None
"""The machine a recipe is checked against: a `Machine`; a function that gives it, called only
when a rule needs it (detecting CUDA imports torch, which a recipe refused for its own
inconsistency should not wait for); or None for `target_machine`."""


def target_machine(config: RecipeConfig) -> Machine:
    """The machine a recipe is meant for (`moe_rl.config.derived.target_device`: CUDA when
    ``run.device`` says so, or ``auto`` on a cluster with GPUs); compute capability unknown."""
    return Machine(cuda=target_device(config) == "cuda")


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
        if self.component in ("recipe", "inputs", "reward"):
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


SKIP_PATHS = "--skip-path-checks"
"""The command-line flag that leaves the input paths to the machines that run the job."""


def input_rules(config: RecipeConfig, paths: bool = True) -> tuple[list[Rule], RunInputs | None]:
    """The files a run reads, as this machine sees them (relative paths from where the command
    runs): the dataset of `data.task`, the stored trajectories of `data.trajectories`, the model
    checkpoint of `model.hf_path` (a folder with ``config.json`` and ``*.safetensors``, of an
    architecture the trainer converts: `moe_rl.megatron.rules.checkpoint_rule`); a real dataset
    without `model.hf_path` is warned about (the model would start from random weights).
    When they are there, what a user gave is read as the run will read it (`_read_rule`): the rules,
    and the inputs read (None: none was). ``paths=False``: none is looked at (they exist only where
    the job runs)."""
    if not paths:
        skipped = Rule(
            "input paths", True,
            f"not checked ({SKIP_PATHS}): the files, and the code a recipe names, are left to the machines "
            "the job runs on",
        )  # fmt: skip
        return [skipped], None
    here = f"as seen from {Path.cwd()}; {SKIP_PATHS} if it exists only where the job runs"
    rules = []
    source = config.data.source
    if source.is_file:
        rules.append(_path_rule("dataset exists", f"data.task={source}", Path(source.name), "file", here))
    if config.data.trajectories is not None:
        trajectories = config.data.trajectories
        rules.append(
            _path_rule(
                "stored trajectories exist",
                f"data.trajectories={trajectories}",
                Path(trajectories),
                "any",
                here,
            )
        )
    hf_path = config.model.hf_path
    if hf_path is None:
        rules.append(Rule(
            "model weights given", not source.is_file,
            f"model.hf_path is null with data.task={config.data.task}", fatal=False,
            advice="the model starts from random weights; set model.hf_path to the checkpoint to train",
        ))  # fmt: skip
    else:
        folder = Path(hf_path)
        rule = _path_rule("model checkpoint exists", f"model.hf_path={hf_path}", folder, "folder", here)
        if (
            _missing(folder)
            and config.model.family == Family.QWEN3_MOE
            and config.model.attention == Attention.GQA
        ):
            rule = Rule(
                rule.name,
                False,
                f"{rule.detail}; `moe-rl make-model` writes a random-init one there to try the recipe",
            )
        elif rule.ok and not (folder / "config.json").is_file():
            rule = Rule(rule.name, False, f"model.hf_path={hf_path}: no config.json in the folder ({here})")
        elif rule.ok and not any(folder.glob("*.safetensors")):
            rule = Rule(
                rule.name, False, f"model.hf_path={hf_path}: no *.safetensors weights in the folder ({here})"
            )
        rules.append(rule)
        if rule.ok:  # what the folder holds: the Megatron layer says what it converts
            rules.append(checkpoint_rule(config.model, folder))
    inputs = None
    if reads_user_inputs(config) and not any(rule.broken for rule in rules):
        read, inputs = _read_rule(config)
        rules.append(read)
    if config.model.init_from is not None:
        rules.append(_init_rule(config.model.init_from, here))
    if config.teacher.path is not None:
        rules += _teacher_rules(config, here)
    return rules or [Rule("input paths", True, "the recipe reads no files")], inputs


def _teacher_rules(config: RecipeConfig, here: str) -> list[Rule]:
    """The distillation teacher: its weights and architecture found (`teacher_source`: the student's
    vocabulary), and its model in the trainer's layout (`model_rules` on the teacher's model)."""
    import dataclasses

    from moe_rl.megatron.rules import model_rules
    from moe_rl.trainer.teacher import teacher_source

    try:
        source = teacher_source(config)
    except (UserError, ConfigError) as exc:
        return [Rule("teacher found", False, f"{exc} ({here})")]
    m = source.model
    found = Rule(
        "teacher found", True,
        f"teacher.path={clip(config.teacher.path, 2 * BRIEF_CHARS)}: {source.weights} ({m.family}, "
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts)",
    )  # fmt: skip
    layout = model_rules(dataclasses.replace(config, model=m))
    return [found, *(Rule(f"teacher: {r.name}", r.ok, r.values, r.fatal, r.advice) for r in layout)]


def _init_rule(init_from: str, here: str) -> Rule:
    """`model.init_from` names a checkpoint there is: a run directory with a usable one, or one
    checkpoint folder with its trainer state."""
    from moe_rl.run_dir import init_checkpoint

    try:
        found = init_checkpoint(Path(init_from))
    except UserError as exc:
        return Rule("starting checkpoint exists", False, f"{exc} ({here})")
    return Rule("starting checkpoint exists", True, f"model.init_from={init_from}: {found}")


def reads_user_inputs(config: RecipeConfig) -> bool:
    """Whether the run reads what a user gave: a dataset file, stored trajectories, a reward
    function or an environment of their own (`env.kwargs` of a built-in one count too)."""
    reward = ":" in config.data.reward
    given = config.data.trajectories, config.sft.demonstrations, config.env.name
    return config.data.source.is_file or reward or any(g is not None for g in given)


def _read_rule(config: RecipeConfig) -> tuple[Rule, RunInputs | None]:
    """Read the inputs as the run will (`build_inputs`): every dataset row tokenized and measured,
    every stored trajectory validated, the reward function imported, one environment built. The
    rule, and the inputs read (None: they could not be)."""
    try:
        inputs = build_inputs(config)
    except UserError as exc:
        return Rule("inputs read", False, str(exc)), None
    except OSError as exc:
        fault = user_error_of(exc)
        if fault is None:
            raise
        return Rule("inputs read", False, str(fault)), None
    read = []
    if config.data.source.is_file:
        read.append(
            f"every prompt of {config.data.task} within data.max_prompt_len={config.data.max_prompt_len}"
        )
    if config.data.trajectories is not None:
        read.append(f"the stored trajectories of {config.data.trajectories}")
    if inputs.offline_data is not None and config.sft.demonstrations is not None:
        read.append(f"{inputs.offline_data.num_samples} demonstrations ({config.sft.demonstrations})")
    if config.env.name is not None:
        read.append(f"env.name={config.env.name} built with env.kwargs")
    elif ":" in config.data.reward:
        read.append(f"data.reward={config.data.reward} imported")
    return Rule("inputs read", True, "; ".join(read)), inputs


def _missing(path: Path) -> bool:
    """``path`` does not exist (a name the system cannot look up is not called missing)."""
    try:
        return not path.exists()
    except OSError:
        return False


def _path_rule(name: str, key: str, path: Path, kind: str, here: str) -> Rule:
    """``path`` (given as ``key``, cut for the line) exists as a ``kind`` and can be read."""
    key = clip(key, 2 * BRIEF_CHARS)
    try:
        if not path.exists():
            return Rule(name, False, f"{key}: no such {'file or folder' if kind == 'any' else kind} ({here})")
        if kind == "file" and path.is_dir():
            return Rule(name, False, f"{key}: is a folder, not a file ({here})")
        if kind == "folder" and not path.is_dir():
            return Rule(name, False, f"{key}: is a file, not a folder ({here})")
    except OSError as exc:  # a name the system cannot look up (too long, ...)
        return Rule(name, False, f"{key}: {(exc.strerror or str(exc)).lower()} ({here})")
    if not os.access(path, os.R_OK):
        return Rule(name, False, f"{key}: cannot be read (permission denied)")
    return Rule(name, True, f"{key}: found")


class _Inputs:
    """The ``inputs`` component: its rules (`input_rules`), and what they read."""

    def __init__(self, config: RecipeConfig, paths: bool):
        self.config, self.paths = config, paths
        self.read: RunInputs | None = None

    def __call__(self) -> list[Rule]:
        rules, self.read = input_rules(self.config, self.paths)
        return rules


def _components(
    config: RecipeConfig, machine: Callable[[], Machine], inputs: _Inputs
) -> dict[str, Callable[[], list[Rule]]]:
    """The components asked, in order, and their rules; the ones after ``recipe`` assume a
    consistent recipe."""
    return {
        "recipe": lambda: recipe_rules(config),
        "inputs": inputs,
        "reward": lambda: reward_rules(config),
        "trainer": lambda: trainer_rules(config),
        "engine": lambda: engine_rules(config, machine()),
        "placement": lambda: placement_rules(config, machine()),
    }


@dataclass(frozen=True)
class Preflight:
    """What the preflight found: every component asked, with its rules, and the run's inputs where
    it read them."""

    sections: tuple[Section, ...]
    inputs: RunInputs | None
    """What the ``inputs`` rules read (`build_inputs`); None when the recipe reads nothing a user
    gave, the paths were not checked, or a rule refused them."""


def preflight(
    config: RecipeConfig, machine: MachineSpec = None, stop_at_first: bool = False, paths: bool = True
) -> Preflight:
    """Every component's rules on ``config`` against ``machine`` (default: `target_machine`), in
    `_components` order. A recipe that is not consistent in itself gets only its ``recipe`` section
    (the others assume it is). ``stop_at_first``: stop after the first section that refuses it, so
    a machine given as a function is not detected for a recipe refused before a rule needs it.
    ``paths``: check the input paths and read what they hold (`input_rules`)."""
    sections: list[Section] = []
    inputs = _Inputs(config, paths)
    for component, rules in _components(config, _machine(config, machine), inputs).items():
        section = Section(component, tuple(rules()))
        sections.append(section)
        if section.broken is not None and (stop_at_first or component == "recipe"):
            break
    return Preflight(tuple(sections), inputs.read)


def check(config: RecipeConfig, machine: MachineSpec = None, paths: bool = True) -> RunInputs | None:
    """Enforce every component's rules: raise `ConfigError` with the first refusal (the components
    after it are not asked); log the warnings of those asked. Returns the inputs the check read
    (`Preflight.inputs`)."""
    found = preflight(config, machine, stop_at_first=True, paths=paths)
    for section in found.sections:
        error = section.error()
        if error is not None:
            raise ConfigError(error)
        for rule in section.warnings:
            log.warning("%s", rule.detail)
    return found.inputs


def run_inputs(config: RecipeConfig, machine: MachineSpec = None) -> RunInputs:
    """The preflight of a run that starts here: every rule enforced, the input paths checked
    (`check`), and the run's inputs: those the check read, or, for a recipe that reads nothing a
    user gave (a synthetic task), the ones built now."""
    inputs = check(config, machine)
    return build_inputs(config) if inputs is None else inputs


def load_checked(
    recipe: str | Path, overrides: Sequence[str] = (), machine: MachineSpec = None, paths: bool = True
) -> RecipeConfig:
    """`load_recipe`, then `check`: a recipe every component accepts."""
    config = load_recipe(recipe, overrides)
    check(config, machine, paths)
    return config


@dataclass
class RunInputs:
    """What a run reads before it starts anything heavy, built once by `build_inputs` and handed
    to the run: the prompt stream, the stored trajectories of an offline run (validated against
    the model), and the scorer of `data.reward` or the environment factory of `env.name`."""

    prompt_source: PromptSource
    offline_data: TrajectoryBatch | None = None
    scorer: RewardScorer | None = None
    """What scores responses (None with an environment, whose rewards are in the batch)."""
    env_factory: Callable[[], Environment] | None = None


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
    elif config.sft.demonstrations is not None:  # `moe-rl sft`: the demonstrations are the data
        from moe_rl.orchestration.sft import build_demonstrations

        offline = build_demonstrations(config)
    source = build_prompt_source(config)  # offline runs draw evaluation prompts from it
    if config.env.name:  # the environment gives the rewards: import it and build one
        from moe_rl.envs.registry import build_env_factory

        return RunInputs(
            source, offline, env_factory=build_env_factory(config.env.name, dict(config.env.kwargs))
        )
    return RunInputs(source, offline, scorer=build_scorer(config))
