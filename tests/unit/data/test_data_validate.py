"""validate() on a hand-built batch and on one malformed variant per rule."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_rl.data import TrajectoryBatch, TrajectoryError, check_staleness, validate

VOCAB = 16


def test_hand_built_batch_is_valid(hand_batch: TrajectoryBatch) -> None:
    validate(hand_batch, vocab_size=VOCAB)
    assert (hand_batch.routing_lengths() - hand_batch.sequence_lengths()).tolist() == [0, -1, 0]  # both valid
    assert hand_batch.token_versions().tolist() == [3, 3, 3, 3, 4]


def test_small_positive_logp_within_tolerance_is_accepted(hand_batch: TrajectoryBatch) -> None:
    hand_batch.rollout_logp[0] = 5e-5
    validate(hand_batch)


def _set(name: str, index: object, value: object) -> Callable[[TrajectoryBatch], None]:
    def mutate(b: TrajectoryBatch) -> None:
        getattr(b, name)[index] = value

    return mutate


def _replace(**changes: object) -> Callable[[TrajectoryBatch], None]:
    def mutate(b: TrajectoryBatch) -> None:
        for name, value in changes.items():
            setattr(b, name, value(b) if callable(value) else value)

    return mutate


def _shorten_last_trace(b: TrajectoryBatch) -> None:
    """Sample 1's trace is one token short already; cut one more row from it."""
    assert b.routed_experts is not None and b.routing_offsets is not None
    cut = int(b.routing_offsets[2]) - 1
    b.routed_experts = torch.cat([b.routed_experts[:cut], b.routed_experts[cut + 1 :]])
    b.routing_offsets[2:] -= 1


# (id, mutation, field named in the error, sample named in the error or None)
MALFORMED = [
    ("prompt-offsets-not-monotone", _set("prompt_offsets", 1, 5), "prompt_offsets", 1),
    ("prompt-offsets-not-from-zero", _set("prompt_offsets", 0, 1), "prompt_offsets", None),
    ("response-offsets-wrong-end", _set("response_offsets", 3, 4), "response_offsets", None),
    ("empty-prompt", _set("prompt_offsets", 1, 0), "prompt_ids", None),
    ("prompt-id-negative", _set("prompt_ids", 4, -1), "prompt_ids", 2),
    ("response-id-outside-vocab", _set("response_ids", 3, VOCAB), "response_ids", 1),
    ("logp-nan", _set("rollout_logp", 1, float("nan")), "rollout_logp", 0),
    ("logp-inf", _set("rollout_logp", 2, float("-inf")), "rollout_logp", 1),
    ("logp-positive", _set("rollout_logp", 4, 0.5), "rollout_logp", 1),
    ("old-logp-positive", _set("old_logp", 0, 0.01), "old_logp", 0),
    ("logp-float64", _replace(rollout_logp=lambda b: b.rollout_logp.double()), "rollout_logp", None),
    ("logp-wrong-length", _replace(rollout_logp=lambda b: b.rollout_logp[:-1]), "rollout_logp", None),
    ("reward-nan", _set("rewards", 2, float("nan")), "rewards", 2),
    ("rewards-wrong-length", _replace(rewards=lambda b: b.rewards[:2]), "rewards", None),
    ("group-ids-float", _replace(group_ids=lambda b: b.group_ids.float()), "group_ids", None),
    ("finish-reason-unknown", _set("finish_reasons", 1, "eos"), "finish_reasons", 1),
    ("finish-reasons-short", _replace(finish_reasons=lambda b: b.finish_reasons[:2]), "finish_reasons", None),
    ("engine-empty", _replace(engine=""), "engine", None),
    ("policy-version-negative", _replace(policy_version=-1), "policy_version", None),
    ("span-not-from-zero", _set("version_span_starts", 1, 1), "version_span_starts", 1),
    ("span-starts-not-increasing", _set("version_span_starts", 2, 0), "version_span_starts", 1),
    ("span-versions-decreasing", _set("version_span_versions", 2, 2), "version_span_versions", 1),
    ("span-versions-equal-neighbours", _set("version_span_versions", 2, 3), "version_span_versions", 1),
    ("span-past-response-end", _set("version_span_starts", 2, 3), "version_span_starts", 1),
    ("span-version-above-policy", _set("version_span_versions", 3, 9), "version_span_versions", 2),
    ("sample-without-span", _set("version_span_offsets", 1, 0), "version_span_starts", 0),
    ("sampled-token-not-kept", _set("sampling_mask_ids", 2, 6), "sampling_mask_ids", 0),
    ("kept-id-duplicate", _set("sampling_mask_ids", 4, 8), "sampling_mask_ids", 1),
    ("kept-id-outside-vocab", _set("sampling_mask_ids", 4, VOCAB + 3), "sampling_mask_ids", 1),
    (
        "kept-set-empty",
        _replace(sampling_mask_offsets=lambda b: torch.tensor([0, 2, 2, 4, 6, 9])),
        "sampling_mask_offsets",
        0,
    ),
    (
        "mask-offsets-wrong-length",
        _replace(sampling_mask_offsets=lambda b: b.sampling_mask_offsets[:-1]),
        "sampling_mask_offsets",
        None,
    ),
    ("mask-ids-without-offsets", _replace(sampling_mask_offsets=None), "sampling_mask_offsets", None),
    ("expert-id-too-large", _set("routed_experts", (6, 1, 0), 8), "routed_experts", 1),
    ("expert-id-duplicate", _set("routed_experts", (0, 0, 1), 0), "routed_experts", 0),
    ("routing-trace-too-short", _shorten_last_trace, "routing_offsets", 1),
    (
        "routing-trace-too-long",
        _replace(
            routing_offsets=lambda b: torch.tensor([0, 6, 9, 11]),
            routed_experts=lambda b: torch.cat([b.routed_experts[:1], b.routed_experts]),
        ),
        "routing_offsets",
        0,
    ),
    ("routing-layer-count-mismatch", _replace(num_moe_layers=3), "routed_experts", None),
    ("routing-topk-mismatch", _replace(topk=1), "routed_experts", None),
    ("routing-int64", _replace(routed_experts=lambda b: b.routed_experts.long()), "routed_experts", None),
    (
        "routing-uint16-for-8-experts",
        _replace(routed_experts=lambda b: b.routed_experts.to(torch.uint16)),
        "routed_experts",
        None,
    ),
    ("routing-without-offsets", _replace(routing_offsets=None), "routing_offsets", None),
    ("topk-above-num-experts", _replace(topk=9), "topk", None),
]


@pytest.mark.parametrize(
    ("mutate", "field", "sample"), [pytest.param(m, f, s, id=i) for i, m, f, s in MALFORMED]
)
def test_malformed_batch_is_rejected_naming_field(
    make_hand_batch: Callable[[], TrajectoryBatch],
    mutate: Callable[[TrajectoryBatch], None],
    field: str,
    sample: int | None,
) -> None:
    batch = make_hand_batch()
    mutate(batch)
    with pytest.raises(TrajectoryError) as err:
        validate(batch, vocab_size=VOCAB)
    assert err.value.field == field
    assert str(err.value).startswith(field)
    if sample is not None:
        assert err.value.sample == sample
        assert f"sample {sample}" in str(err.value)


def test_error_names_token_and_value(hand_batch: TrajectoryBatch) -> None:
    hand_batch.rollout_logp[4] = 0.25
    with pytest.raises(TrajectoryError, match=r"rollout_logp \(sample 1, token 2\).*got 0.25.*<= 0.0001"):
        validate(hand_batch)


def test_routing_error_names_layer(hand_batch: TrajectoryBatch) -> None:
    assert hand_batch.routed_experts is not None
    hand_batch.routed_experts[6, 1, 0] = 8
    with pytest.raises(TrajectoryError, match=r"routed_experts \(sample 1, token 1\).*MoE layer 1"):
        validate(hand_batch)


def test_staleness_within_bound_passes(hand_batch: TrajectoryBatch) -> None:
    check_staleness(hand_batch, current_version=5, max_staleness=2)


def test_staleness_names_old_samples(hand_batch: TrajectoryBatch) -> None:
    with pytest.raises(
        TrajectoryError, match=r"version_span_versions \(sample 0\).*3 sample\(s\) older"
    ) as err:
        check_staleness(hand_batch, current_version=7, max_staleness=2)
    assert err.value.sample == 0


def test_staleness_is_judged_by_a_samples_oldest_span(hand_batch: TrajectoryBatch) -> None:
    # oldest versions [3, 3, 4]: at version 6, samples 0 and 1 are 3 old; sample 1's newer span
    # (2, 4) does not make it fresher
    with pytest.raises(TrajectoryError, match=r"2 sample\(s\) older.*\{0: 3, 1: 3\}"):
        check_staleness(hand_batch, current_version=6, max_staleness=2)
    with pytest.raises(TrajectoryError, match=r"1 sample\(s\) older.*\{0: 3\}") as err:
        check_staleness(hand_batch.select([1]), current_version=6, max_staleness=2)
    assert err.value.value == 3


def test_staleness_rejects_versions_from_the_future(hand_batch: TrajectoryBatch) -> None:
    with pytest.raises(TrajectoryError, match="newer than the trainer") as err:
        check_staleness(hand_batch, current_version=3, max_staleness=8)
    assert err.value.sample == 1
