"""Correction combinations the trainer refuses before anything loads, each naming its fields."""

from __future__ import annotations

import pytest
from trainer_testing import tiny_recipe

from moe_rl.trainer.rules import check_trainer, trainer_rules


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["algo.corrections.tis.mode=token"], r"icepop.enabled=True with algo.corrections.tis.mode=token"),
        (
            ["algo.corrections.rejection.enabled=true", "algo.corrections.rejection.divergence=k3"],
            r"rejection.divergence=k3 with low=0.999",
        ),
    ],
)
def test_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_trainer(tiny_recipe(*overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.corrections.tis.mode=token", "algo.corrections.icepop.enabled=false"],
        [
            "algo.corrections.rejection.enabled=true",
            "algo.corrections.rejection.divergence=k3",
            "algo.corrections.rejection.low=0",
            "algo.corrections.rejection.high=0.01",
        ],
        ["algo.corrections.rejection.enabled=true"],  # k1's ratio band
    ],
)
def test_accepted(overrides):
    check_trainer(tiny_recipe(*overrides))


NO_KSM = "algo.corrections.keep_sampling_mask=false"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["algo.policy_mode=bypass", "rollout.top_p=0.7", NO_KSM], True),
        (["algo.policy_mode=bypass", "rollout.top_k=8", NO_KSM], True),
        (["algo.policy_mode=bypass", NO_KSM], False),
        (["rollout.top_p=0.7", NO_KSM], False),
        (["algo.policy_mode=bypass", "rollout.top_p=0.7"], False),
    ],
    ids=["bypass-top_p", "bypass-top_k", "nothing-truncated", "decoupled", "kept-set-log-probs"],
)
def test_bypass_over_truncated_sampling_is_warned(overrides, warned):
    config = tiny_recipe(*overrides)
    check_trainer(config)  # a warning, not a refusal
    (rule,) = [r for r in trainer_rules(config) if r.name == "bypass ratio over the kept tokens"]
    assert rule.ok is not warned and not rule.broken
    if warned:
        assert "keep_sampling_mask=true" in rule.detail and "algo.policy_mode=bypass" in rule.detail
