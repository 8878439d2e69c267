"""The zero-update test samples with the recipe's sampling, seeded by the run's seed function for a
purpose of its own (`moe-rl diagnose` and the in-training probe draw apart from every rollout)."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config.loader import load_recipe
from moe_rl.diagnostics import binding
from moe_rl.rollout.engine import Purpose, sampling_seed

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def test_the_diagnose_sampling_has_a_seed_of_its_own():
    config = load_recipe(TINY, ["run.seed=3"])
    spec = binding.sampling_spec(config)
    # the purpose's index (4) in the low word, above the step
    assert spec.seed == sampling_seed(3, Purpose.DIAGNOSE, 0) == 300_009 + 4 * (1 << 20)
    assert spec.n == config.rollout.group_size and spec.stop_token_ids == (config.model.eos_token_id,)
