"""TrajectoryBatch helpers: per-sample views, select, concat, versions."""

from __future__ import annotations

import pytest
import torch

from moe_rl.data import TrajectoryBatch, TrajectoryError, first_difference, validate
from moe_rl.data.synthetic import random_batch


def test_sample_views_return_what_was_built(hand_batch: TrajectoryBatch) -> None:
    s1 = hand_batch.sample(1)
    assert s1.prompt_ids.tolist() == [6]
    assert s1.response_ids.tolist() == [7, 8, 9]
    assert s1.rollout_logp.tolist() == [-1.0, -2.0, -0.5]
    assert s1.version_spans == [(0, 3), (2, 4)]
    assert s1.sampling_mask_offsets is not None and s1.sampling_mask_offsets.tolist() == [0, 1, 3, 6]
    assert s1.sampling_mask_ids is not None and s1.sampling_mask_ids.tolist() == [7, 1, 8, 9, 2, 3]
    assert s1.routed_experts is not None and s1.routed_experts.shape == (3, 2, 2)
    assert (s1.finish_reason, s1.group_id, s1.reward) == ("length", 0, 0.0)
    assert hand_batch.routed_experts is not None and hand_batch.routed_experts.dtype == torch.uint8
    with pytest.raises(IndexError):
        hand_batch.sample(3)


def test_from_samples_of_views_rebuilds_the_batch(hand_batch: TrajectoryBatch) -> None:
    rebuilt = TrajectoryBatch.from_samples(
        list(hand_batch.samples()), engine="vllm", quant_recipe="fp8", policy_version=4, num_experts=8
    )
    assert first_difference(rebuilt, hand_batch) is None


def test_select_then_concat_matches_select_of_union() -> None:
    batch = random_batch(3, 7, routing=(3, 2, 300), sampling_mask=True, old_logp=True)
    left, right = batch.select([4, 0, 0]), batch.select(torch.tensor([6, 2]))
    joined = TrajectoryBatch.concat([left, right])
    validate(joined)
    assert first_difference(joined, batch.select([4, 0, 0, 6, 2])) is None
    assert joined.sample(0).response_ids.tolist() == batch.sample(4).response_ids.tolist()
    assert joined.routed_experts is not None and joined.routed_experts.dtype == torch.uint16


def test_select_identity_and_empty(hand_batch: TrajectoryBatch) -> None:
    assert first_difference(hand_batch.select(range(3)), hand_batch) is None
    empty = hand_batch.select([])
    validate(empty)
    assert empty.num_samples == 0 and empty.num_response_tokens == 0
    with pytest.raises(IndexError):
        hand_batch.select([3])


def test_versions(hand_batch: TrajectoryBatch) -> None:
    assert hand_batch.token_versions().tolist() == [3, 3, 3, 3, 4]
    assert hand_batch.sample_min_versions().tolist() == [3, 3, 4]
    assert hand_batch.sample_max_versions().tolist() == [3, 4, 4]
    assert (hand_batch.min_policy_version(), hand_batch.max_policy_version()) == (3, 4)


def test_concat_keeps_newest_policy_version(hand_batch: TrajectoryBatch) -> None:
    newer = hand_batch.replace(policy_version=9)
    assert TrajectoryBatch.concat([hand_batch, newer]).policy_version == 9


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param({"quant_recipe": "bf16"}, "quant_recipe", id="quant-recipe"),
        pytest.param({"engine": "megatron"}, "engine", id="engine"),
        pytest.param(
            {"sampling_mask_ids": None, "sampling_mask_offsets": None}, "sampling_mask_ids", id="mask"
        ),
        pytest.param({"old_logp": None}, "old_logp", id="old-logp"),
    ],
)
def test_concat_refuses_incompatible_batches(hand_batch: TrajectoryBatch, change: dict, field: str) -> None:
    with pytest.raises(TrajectoryError) as err:
        TrajectoryBatch.concat([hand_batch, hand_batch.replace(**change)])
    assert err.value.field == field


def test_concat_of_nothing_is_an_error() -> None:
    with pytest.raises(TrajectoryError, match="batches"):
        TrajectoryBatch.concat([])


def test_from_samples_requires_num_experts_with_routing(hand_batch: TrajectoryBatch) -> None:
    with pytest.raises(TrajectoryError, match="num_experts"):
        TrajectoryBatch.from_samples(
            list(hand_batch.samples()), engine="vllm", quant_recipe="fp8", policy_version=4
        )


def test_from_samples_refuses_routing_on_some_samples_only(hand_batch: TrajectoryBatch) -> None:
    samples = list(hand_batch.samples())
    samples[2].routed_experts = None
    with pytest.raises(TrajectoryError, match=r"routed_experts \(sample 2\)"):
        TrajectoryBatch.from_samples(
            samples, engine="vllm", quant_recipe="fp8", policy_version=4, num_experts=8
        )


def test_first_difference_sees_nan_payload_and_dtype(hand_batch: TrajectoryBatch) -> None:
    a = hand_batch.replace(rollout_logp=torch.tensor([float("nan")] * 5))
    b = hand_batch.replace(rollout_logp=-torch.tensor([float("nan")] * 5))  # sign bit differs
    assert first_difference(a, a.replace()) is None
    assert first_difference(a, b) == "rollout_logp"
    assert (
        first_difference(hand_batch, hand_batch.replace(group_ids=hand_batch.group_ids.int())) == "group_ids"
    )


@pytest.mark.parametrize(("start", "stop"), [(0, 7), (2, 5), (3, 3), (6, 7)])
def test_slice_is_select_of_a_range_without_copy(start: int, stop: int) -> None:
    batch = random_batch(8, 7, routing=(2, 2, 300), sampling_mask=True, old_logp=True)
    view = batch.slice(start, stop)
    validate(view)
    assert first_difference(view, batch.select(range(start, stop))) is None
    if stop > start and view.num_response_tokens:
        assert (
            view.response_ids.data_ptr()
            == batch.response_ids[int(batch.response_offsets[start]) :].data_ptr()
        )
    with pytest.raises(IndexError):
        batch.slice(5, 8)
