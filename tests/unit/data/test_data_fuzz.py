"""Property tests: random valid batches validate, round-trip bit-exactly, pack consistently;
one mutated field is rejected with that field named."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_rl.data import TrajectoryBatch, TrajectoryError, first_difference, validate
from moe_rl.data.packing import pack_microbatches
from moe_rl.data.shards import read_shards, write_shards
from moe_rl.data.synthetic import random_batch

ROUTING = st.one_of(
    st.none(),
    st.tuples(st.integers(1, 3), st.integers(1, 4), st.sampled_from([4, 16, 256, 257, 384, 1000])),
)


@st.composite
def batches(draw: st.DrawFn, *, full: bool = False) -> tuple[TrajectoryBatch, int]:
    """A valid random batch and its vocabulary size; ``full`` forces >= 1 sample, routing and masks."""
    vocab = draw(st.sampled_from([2, 7, 64]))
    batch = random_batch(
        draw(st.integers(0, 2**31 - 1)),
        draw(st.integers(1 if full else 0, 6)),
        max_prompt_len=draw(st.integers(1, 6)),
        max_response_len=draw(st.integers(1 if full else 0, 6)),
        vocab_size=vocab,
        routing=draw(ROUTING.filter(lambda r: r is not None) if full else ROUTING),
        sampling_mask=full or draw(st.booleans()),
        old_logp=draw(st.booleans()),
    )
    return batch, vocab


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(1, 4))
def test_valid_batches_validate_and_round_trip(drawn: tuple[TrajectoryBatch, int], per_shard: int) -> None:
    batch, vocab = drawn
    validate(batch, vocab_size=vocab)
    with tempfile.TemporaryDirectory() as tmp:
        write_shards([batch, batch], tmp, max_samples_per_shard=per_shard, include_old_logp=True)
        restored = list(read_shards(tmp))
    if batch.num_samples:
        assert (
            first_difference(TrajectoryBatch.concat(restored), TrajectoryBatch.concat([batch, batch])) is None
        )
    else:
        assert restored == []


@settings(max_examples=25, deadline=None)
@given(batches())
def test_packing_conserves_tokens(drawn: tuple[TrajectoryBatch, int]) -> None:
    batch, _ = drawn
    budget = max(int(batch.sequence_lengths().max()), 1) if batch.num_samples else 1
    mbs = pack_microbatches(batch, budget)
    assert sum(mb.num_tokens for mb in mbs) == int(batch.sequence_lengths().sum())
    for mb in mbs:
        assert torch.equal(
            mb.input_ids[mb.response_positions], batch.response_ids[mb.response_token_index].long()
        )
        assert int(mb.loss_mask.sum()) == mb.response_positions.numel()
        if mb.routed_experts is not None:
            assert mb.routed_experts.shape[0] == mb.num_tokens


# ---- mutations: each returns the field it breaks, or None when it does not apply to the batch ----
Mutation = Callable[[TrajectoryBatch, st.DataObject, int], str | None]


def _token(batch: TrajectoryBatch, data: st.DataObject) -> int | None:
    n = batch.num_response_tokens
    return data.draw(st.integers(0, n - 1)) if n else None


def _sample(batch: TrajectoryBatch, data: st.DataObject) -> int | None:
    return data.draw(st.integers(0, batch.num_samples - 1)) if batch.num_samples else None


def positive_logp(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    t = _token(b, data)
    if t is None:
        return None
    b.rollout_logp[t] = data.draw(st.sampled_from([0.01, 3.0, float("nan"), float("inf")]))
    return "rollout_logp"


def prompt_out_of_vocab(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    if b.num_samples == 0:
        return None
    b.prompt_ids[data.draw(st.integers(0, b.prompt_ids.numel() - 1))] = data.draw(
        st.sampled_from([-1, 10**6])
    )
    return "prompt_ids"


def response_offsets_decrease(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    i = _sample(b, data)
    if i is None:
        return None
    b.response_offsets[i] = b.response_offsets[i + 1] + 1
    return "response_offsets"


def unknown_finish_reason(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    i = _sample(b, data)
    if i is None:
        return None
    b.finish_reasons[i] = "eos"
    return "finish_reasons"


def span_not_from_zero(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    i = _sample(b, data)
    if i is None:
        return None
    b.version_span_starts[b.version_span_offsets[i]] = 1
    return "version_span_starts"


def version_above_policy(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    i = _sample(b, data)
    if i is None:
        return None
    b.version_span_versions[b.version_span_offsets[i + 1] - 1] = b.policy_version + 1
    return "version_span_versions"


def drop_sampled_token_from_mask(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    t = _token(b, data)
    if t is None or b.sampling_mask_ids is None or b.sampling_mask_offsets is None:
        return None
    lo, hi = int(b.sampling_mask_offsets[t]), int(b.sampling_mask_offsets[t + 1])
    row = b.sampling_mask_ids[lo:hi]
    free = sorted(set(range(vocab)) - set(row.tolist()))
    if not free:
        return None
    row[row == b.response_ids[t]] = data.draw(st.sampled_from(free))
    return "sampling_mask_ids"


def empty_kept_set(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    t = _token(b, data)
    if t is None or b.sampling_mask_ids is None or b.sampling_mask_offsets is None:
        return None
    lo, hi = int(b.sampling_mask_offsets[t]), int(b.sampling_mask_offsets[t + 1])
    b.sampling_mask_ids = torch.cat([b.sampling_mask_ids[:lo], b.sampling_mask_ids[hi:]])
    b.sampling_mask_offsets[t + 1 :] -= hi - lo
    return "sampling_mask_offsets"


def expert_out_of_range(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    trace = b.routed_experts
    if trace is None or trace.shape[0] == 0 or b.num_experts in (256, 65536):
        return None
    row = data.draw(st.integers(0, trace.shape[0] - 1))
    trace[row, data.draw(st.integers(0, trace.shape[1] - 1)), 0] = b.num_experts
    return "routed_experts"


def duplicate_expert(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    trace = b.routed_experts
    if trace is None or trace.shape[0] == 0 or trace.shape[2] < 2:
        return None
    row, layer = data.draw(st.integers(0, trace.shape[0] - 1)), data.draw(st.integers(0, trace.shape[1] - 1))
    trace[row, layer, 1] = trace[row, layer, 0]
    return "routed_experts"


def trace_too_long(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    i = _sample(b, data)
    if b.routed_experts is None or b.routing_offsets is None or i is None:
        return None
    at, (_, layers, k) = int(b.routing_offsets[i]), b.routed_experts.shape
    extra = torch.arange(k).to(b.routed_experts.dtype).expand(2, layers, k)
    b.routed_experts = torch.cat([b.routed_experts[:at], extra, b.routed_experts[at:]])
    b.routing_offsets[i + 1 :] += 2
    return "routing_offsets"


def logp_wrong_dtype(b: TrajectoryBatch, data: st.DataObject, vocab: int) -> str | None:
    b.rollout_logp = b.rollout_logp.double()
    return "rollout_logp"


MUTATIONS = [
    positive_logp,
    prompt_out_of_vocab,
    response_offsets_decrease,
    unknown_finish_reason,
    span_not_from_zero,
    version_above_policy,
    drop_sampled_token_from_mask,
    empty_kept_set,
    expert_out_of_range,
    duplicate_expert,
    trace_too_long,
    logp_wrong_dtype,
]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda m: m.__name__)
@settings(max_examples=15, deadline=None)
@given(drawn=batches(full=True), data=st.data())
def test_one_mutated_field_is_rejected_by_name(
    mutate: Mutation, drawn: tuple[TrajectoryBatch, int], data: st.DataObject
) -> None:
    batch, vocab = drawn
    field = mutate(batch, data, vocab)
    assume(field is not None)
    with pytest.raises(TrajectoryError) as err:
        validate(batch, vocab_size=vocab)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(field)
