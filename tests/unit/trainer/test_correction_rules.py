"""Correction combinations the trainer refuses before anything loads, each naming its fields."""

from __future__ import annotations

import pytest
from trainer_testing import tiny_recipe

from moe_rl.trainer.rules import check_trainer


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
