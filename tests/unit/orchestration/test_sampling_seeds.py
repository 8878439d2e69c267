"""A rollout's sampling seeds come from one function of (run seed, purpose, step, generation round,
engine replica): a training step's first round on replica 0 keeps the seed ``run seed · 100003 +
step``, and no two keys of a run share a seed (with one stride for rounds and replicas, round r+1
on replica k took round r's seed on replica k+1)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from moe_rl.orchestration.preflight import load_checked
from moe_rl.orchestration.sampling import (
    MAX_REPLICAS,
    MAX_ROUNDS,
    STEP_SPAN,
    Draw,
    Purpose,
    replica_spec,
    sampling_seed,
)

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def test_a_training_steps_first_round_on_the_first_replica_keeps_its_seed():
    assert [sampling_seed(3, Purpose.TRAIN, step) for step in (0, 1, 29)] == [300_009, 300_010, 300_038]
    config = load_checked(TINY)
    spec = replica_spec(config, Draw(Purpose.TRAIN, 4), 0)
    assert spec.seed == config.run.seed * 100_003 + 4 and spec.n == config.rollout.group_size
    assert spec.stop_token_ids == (config.model.eos_token_id,)
    assert replica_spec(config, Draw(Purpose.EVAL, 4, 2), 1).seed == sampling_seed(
        config.run.seed, Purpose.EVAL, 4, 2, 1
    )


def test_no_two_keys_of_a_run_share_a_seed():
    steps = [0, 1, 2, 1_000_002, 1_000_003, 10_000_000, 20_000_000, STEP_SPAN - 1]
    keys = list(itertools.product(Purpose, steps, [0, 1, 2, MAX_ROUNDS - 1], [0, 1, 2, MAX_REPLICAS - 1]))
    seeds = {sampling_seed(7, *key) for key in keys}
    assert len(seeds) == len(keys)
    # what one stride for rounds and replicas made equal: round 1 on replica 0, round 0 on replica 1
    assert sampling_seed(7, Purpose.TRAIN, 5, 1, 0) != sampling_seed(7, Purpose.TRAIN, 5, 0, 1)
    # what step offsets made equal: an evaluation of step s and training step 10_000_000 + s
    assert sampling_seed(7, Purpose.EVAL, 5) != sampling_seed(7, Purpose.TRAIN, 10_000_005)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ((STEP_SPAN, 0, 0), r"step must be in \[0, 4294967296\); got 4294967296"),
        ((0, MAX_ROUNDS, 0), r"generation round must be in \[0, 256\); got 256"),
        ((0, 0, -1), r"engine replica must be in \[0, 4096\); got -1"),
    ],
)
def test_a_key_outside_the_seeds_range_is_refused(key, message):
    with pytest.raises(ValueError, match=message):
        sampling_seed(1, Purpose.TRAIN, *key)
