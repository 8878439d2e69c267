"""A generation round's replicas sample with the recipe's sampling, stopping at EOS, each seeded by
`sampling_seed` of the round's purpose, step and round and the replica's index."""

from __future__ import annotations

from pathlib import Path

from moe_rl.orchestration.preflight import load_checked
from moe_rl.orchestration.sampling import Draw, replica_spec
from moe_rl.rollout.engine import Purpose, sampling_seed

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def test_a_replicas_spec_is_the_recipes_seeded_by_its_draw():
    config = load_checked(TINY)
    spec = replica_spec(config, Draw(Purpose.TRAIN, 4), 0)
    assert spec.seed == config.run.seed * 100_003 + 4 and spec.n == config.rollout.group_size
    assert spec.stop_token_ids == (config.model.eos_token_id,)
    assert replica_spec(config, Draw(Purpose.EVAL, 4, 2), 1).seed == sampling_seed(
        config.run.seed, Purpose.EVAL, 4, 2, 1
    )
