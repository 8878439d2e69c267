"""Where the recipe meets the diagnostics: the sampling spec, the recipe's own stability setup,
the mode it trains with, and the advantages of a diagnostic batch (for the OPSM share)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from moe_rl.config.modes import ReplayMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.diagnostics.results import is_number
from moe_rl.diagnostics.verdicts import Setup


def setup_of(config: RecipeConfig) -> Setup:
    """What the recipe already switches on (the verdicts recommend only the rest)."""
    c = config.algo.corrections
    return Setup(
        routing_replay=config.algo.routing_replay,
        keep_sampling_mask=c.keep_sampling_mask,
        icepop=c.icepop.enabled,
        rejection=c.rejection.enabled,
    )


def _mode(r3: bool, ksm: bool) -> str:
    return {(False, False): "plain", (False, True): "ksm", (True, False): "r3", (True, True): "r3+ksm"}[
        (r3, ksm)
    ]


def requested_modes(config: RecipeConfig) -> tuple[str, ...]:
    """The recipe's own mode, then what it falls back to when the engine lacks routing or
    sampling masks (R3 alone, KSM alone, neither)."""
    r3, ksm = config.algo.routing_replay == ReplayMode.R3, config.algo.corrections.keep_sampling_mask
    return tuple(dict.fromkeys((_mode(r3, ksm), _mode(r3, False), _mode(False, ksm), "plain")))


def configured_mode(config: RecipeConfig, modes: Mapping[str, Mapping[str, Any]]) -> str:
    """The mode the recipe trains with (R3 and KSM as configured), as far as the batch supports it."""
    for mode in requested_modes(config):
        if is_number(modes.get(mode, {}).get("kl_k3")):
            return mode
    return "plain"


def sampling_spec(config: RecipeConfig):
    """The recipe's sampling (n = ``rollout.group_size``), seeded apart from every rollout of a
    run (`moe_rl.rollout.engine.sampling_seed` for the zero-update test, ``Purpose.DIAGNOSE``)."""
    from moe_rl.rollout.engine import Purpose, SamplingSpec, sampling_seed

    eos = config.model.eos_token_id
    spec = SamplingSpec.from_rollout(config.rollout, seed=sampling_seed(config.run.seed, Purpose.DIAGNOSE, 0))
    return dataclasses.replace(spec, stop_token_ids=() if eos is None else (eos,))


def without_requests(config: RecipeConfig) -> RecipeConfig:
    """The recipe with R3 and KSM not required, so an engine that lacks them is still measured
    (their columns then read "not available") instead of refused by `check_recipe`."""
    corrections = dataclasses.replace(config.algo.corrections, keep_sampling_mask=False)
    algo = dataclasses.replace(config.algo, routing_replay="off", corrections=corrections)
    return dataclasses.replace(config, algo=algo)


def advantages(config: RecipeConfig, prompts: Sequence[Any], batch):
    """Per-response advantages of the recipe's estimator on rewards of the task's scorer, or
    None when the prompts are bare token ids (no answers to score against)."""
    import torch

    from moe_rl.algo import registry
    from moe_rl.rewards.registry import build_scorer

    if not prompts or not hasattr(prompts[0], "ids"):
        return None
    per_response = [p for p in prompts for _ in range(batch.num_samples // len(prompts))]
    responses = [s.response_ids.tolist() for s in batch.samples()]
    rewards = torch.tensor(build_scorer(config).score_all(per_response, responses), dtype=torch.float32)
    return registry.bind_advantage(config.algo.advantage)(rewards=rewards, group_ids=batch.group_ids)
