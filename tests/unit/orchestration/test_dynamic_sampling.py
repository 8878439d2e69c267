"""Dynamic sampling (`algo.dynamic_sampling`, DAPO): groups whose rewards all agree are dropped and
the batch is refilled from further rounds (`GroupPool`), up to the round bound; in the loop every
step trains a full batch whose only flat groups are those the bound forced it to keep."""

from __future__ import annotations

import pytest
import torch

from moe_rl.data.synthetic import random_batch
from moe_rl.orchestration.dynamic_sampling import GroupPool

N = 2  # responses per prompt


def _round(seed: int, rewards: list[list[float]]):
    batch = random_batch(seed, N * len(rewards), group_size=N)
    return batch.replace(rewards=torch.tensor([r for group in rewards for r in group]))


def _groups(batch) -> list[tuple[int, ...]]:
    """Each group's first response, to tell the groups apart."""
    return [tuple(batch.sample(g * N).response_ids.tolist()) for g in range(batch.num_samples // N)]


def test_varied_groups_are_kept_in_order_until_the_batch_is_full():
    pool = GroupPool(target=3, group_size=N)
    first = _round(1, [[1, 0], [1, 1], [0, 0]])
    pool.add(first)
    assert pool.num_kept == 1 and pool.prompts_wanted() == 3  # 2 missing at a kept share of 1/3
    second = _round(2, [[0, 1], [0, 0], [1, 0.5]])
    pool.add(second)
    assert pool.prompts_wanted() == 0
    batch, metrics = pool.take(torch.tensor([10, 11, 12]))
    assert _groups(batch) == [_groups(first)[0], _groups(second)[0], _groups(second)[2]]
    assert batch.rewards.tolist() == [1, 0, 0, 1, 1, 0.5]
    assert batch.group_ids.tolist() == [10, 10, 11, 11, 12, 12]
    assert metrics == {
        "sampling/rounds": 2, "sampling/generated_groups": 6, "sampling/dropped_group_share": 0.5,
        "sampling/flat_kept_groups": 0, "sampling/surplus_groups": 0,
    }  # fmt: skip


def test_a_short_batch_after_the_last_round_keeps_flat_groups_and_drops_the_surplus():
    pool = GroupPool(target=3, group_size=N)
    first = _round(3, [[1, 1], [0, 1], [0, 0]])
    pool.add(first)
    batch, metrics = pool.take(torch.tensor([0, 1, 2]))  # the bound: no round left
    assert _groups(batch) == [_groups(first)[1], _groups(first)[0], _groups(first)[2]]
    assert metrics["sampling/flat_kept_groups"] == 2
    pool = GroupPool(target=1, group_size=N)
    pool.add(_round(4, [[1, 0], [0, 1]]))
    batch, metrics = pool.take(torch.tensor([7]))
    assert batch.num_samples == N and metrics["sampling/surplus_groups"] == 1


def test_the_loop_trains_full_batches_whose_flat_groups_are_only_those_the_bound_kept():
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE

    pytest.importorskip("megatron.core")
    config = load_checked(TINY_RECIPE, [
        *TINY_MODEL_OVERRIDES, "rollout.batch_size=32", "rollout.group_size=4", "algo.dynamic_sampling=true",
        "algo.dynamic_sampling_rounds=3",
    ])  # fmt: skip
    records = list(LocalRun(config).run(3))
    for r in records:
        assert r["rollout/samples"] == 32 and 1 <= r["sampling/rounds"] <= 3
        assert r["advantage/zero_variance_groups"] == r["sampling/flat_kept_groups"]
        if r["sampling/rounds"] < 3:
            assert r["sampling/flat_kept_groups"] == 0
    assert any(r["sampling/dropped_group_share"] > 0 for r in records), records
