"""What the reward worker learns about a rollout batch's policy versions (`batches.validate_and_plan`): the
share of responses sampled by more than one version (`rollout/mixed_version_share`), and whether the
batch is too stale to train on, judged by each response's oldest version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.data import Sample, TrajectoryBatch
from moe_rl.orchestration.batches import length_metrics, validate_and_plan
from moe_rl.orchestration.dispatch import Dispatch, merge

SHARDING = {"vocab_size": 16, "dp_size": 1, "max_tokens_per_microbatch": 64, "num_mini_batches": 1}


def _batch(responses: list[tuple[int, list[tuple[int, int]]]], policy_version: int) -> TrajectoryBatch:
    """One sample per ``(response length, version spans)``, two samples per group."""
    samples = [
        Sample(torch.tensor([1, 2]), torch.arange(n) % 16, torch.full((n,), -0.5), 0.0, i // 2, "stop", spans)
        for i, (n, spans) in enumerate(responses)
    ]
    return TrajectoryBatch.from_samples(
        samples, engine="vllm", quant_recipe="bf16", policy_version=policy_version
    )


def _summary(batch: TrajectoryBatch, version: int, max_staleness: int):
    return validate_and_plan(batch, [0.0] * batch.num_samples, version, max_staleness, **SHARDING)[1]


def test_mixed_version_share_counts_responses_with_more_than_one_version():
    batch = _batch(
        [(2, [(0, 3)]), (3, [(0, 3), (2, 4)]), (1, [(0, 4)]), (4, [(0, 2), (1, 3), (3, 4)])], policy_version=4
    )
    # responses 1 and 3 span two and three versions: 2 of 4 responses (their tokens would be 7 of 10)
    assert length_metrics(batch)["rollout/mixed_version_share"] == 0.5
    assert _summary(batch, 4, 2).metrics["rollout/mixed_version_share"] == 0.5


def test_replicas_at_different_versions_merge_into_an_unmixed_batch_judged_per_response():
    # a sync landed between the replicas: replica 0 sampled at version 3, replica 1 at version 5
    old = _batch([(2, [(0, 3)]), (3, [(0, 3)])], policy_version=4)
    new = _batch([(1, [(0, 5)]), (2, [(0, 5)])], policy_version=5)
    batch = merge([old, new], Dispatch([[0], [1]], group_size=2))
    assert batch.sample_min_versions().tolist() == [3, 3, 5, 5]
    assert length_metrics(batch)["rollout/mixed_version_share"] == 0.0
    assert _summary(batch, 5, 2).stale is None
    stale = _summary(batch, 6, 2)  # 6 − 3 > 2 for replica 0's responses, 6 − 5 <= 2 for replica 1's
    assert stale.plan is None and "2 sample(s) older" in stale.stale and "{0: 3, 1: 3}" in stale.stale


@pytest.mark.parametrize(("version", "stale"), [(5, False), (6, True)])
def test_a_response_is_as_old_as_its_oldest_span(version, stale):
    # spans (0, 3), (2, 4): its first two tokens come from version 3, so at version 6 it is 3 old
    summary = _summary(_batch([(3, [(0, 3), (2, 4)]), (2, [(0, 4)])], policy_version=4), version, 2)
    assert (summary.stale is not None) == stale and (summary.plan is None) == stale
    assert summary.min_version == 3
    if stale:
        assert "1 sample(s) older" in summary.stale and "{0: 3}" in summary.stale


def test_a_dump_writes_the_batch_it_names_and_refuses_one_no_longer_held(tmp_path):
    """The reward worker numbers each batch it shards (`ScoredSummary.scored`) and writes the one a
    rollout names; once a later batch is sharded the earlier one is gone, and asking for it is an
    error, not the later batch written under the earlier step."""
    from moe_rl.config import load_recipe
    from moe_rl.data.shards import read_shards
    from moe_rl.data.synthetic import random_batch
    from moe_rl.orchestration.batches import Rewarder

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"
    rewarder = Rewarder(load_recipe(recipe, ["model.vocab_size=64"]), scorer=None)
    with pytest.raises(
        ValueError, match=r"scored batch 1 is no longer held by the reward worker \(it holds none\)"
    ):
        rewarder.dump(str(tmp_path / "none"), 0, 1)
    first, second = (random_batch(seed, 4, old_logp=True) for seed in (1, 2))
    first.rewards, second.rewards = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 1.0, 0])
    a = rewarder.prepare_stored(first, 0, 1)[1]
    b = rewarder.prepare_stored(second, 0, 1)[1]
    assert (a.scored, b.scored) == (1, 2)
    with pytest.raises(
        ValueError, match=r"scored batch 1 is no longer held by the reward worker \(it holds batch 2\)"
    ):
        rewarder.dump(str(tmp_path / "a"), 0, a.scored)
    rewarder.dump(str(tmp_path / "b"), 1, b.scored)
    (written,) = read_shards(tmp_path / "b")
    assert written.rewards.tolist() == [0, 1.0, 1.0, 0]
