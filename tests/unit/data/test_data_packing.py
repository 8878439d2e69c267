"""Packing keeps every per-token field aligned with its token; budgets are never silently broken."""

from __future__ import annotations

import pytest
import torch

from moe_rl.data import Sample, TrajectoryBatch, TrajectoryError
from moe_rl.data.packing import MicroBatch, pack_microbatches, plan_microbatches, split_balanced
from moe_rl.data.synthetic import random_batch
from tests.unit.data.data_testing import csr_to_lists


def _expected_versions(spans: list[tuple[int, int]], num_tokens: int) -> list[int]:
    return [max((s, v) for s, v in spans if s <= t)[1] for t in range(num_tokens)]


def _check_sample(mb: MicroBatch, k: int, s: Sample) -> None:
    """Reconstruct sample ``s`` from its slot ``k`` in the packed micro-batch."""
    p, r = s.prompt_ids.numel(), s.response_ids.numel()
    c0, c1 = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
    r0, r1 = int(mb.response_offsets[k]), int(mb.response_offsets[k + 1])
    assert (c1 - c0, r1 - r0) == (p + r, r)
    assert mb.input_ids[c0:c1].tolist() == s.prompt_ids.tolist() + s.response_ids.tolist()
    assert mb.position_ids[c0:c1].tolist() == list(range(p + r))
    assert mb.loss_mask[c0:c1].tolist() == [False] * p + [True] * r
    assert mb.response_positions[r0:r1].tolist() == list(range(c0 + p, c1))
    assert torch.equal(mb.rollout_logp[r0:r1], s.rollout_logp)
    assert mb.token_versions[r0:r1].tolist() == _expected_versions(s.version_spans, r)
    if s.old_logp is not None:
        assert mb.old_logp is not None and torch.equal(mb.old_logp[r0:r1], s.old_logp)
    if s.sampling_mask_ids is not None:
        assert mb.sampling_mask_ids is not None and mb.sampling_mask_offsets is not None
        got = csr_to_lists(mb.sampling_mask_ids, mb.sampling_mask_offsets)[r0:r1]
        assert got == csr_to_lists(s.sampling_mask_ids, s.sampling_mask_offsets)
    if s.routed_experts is not None:
        _check_routing(mb, c0, c1, s.routed_experts)


def _check_routing(mb: MicroBatch, c0: int, c1: int, trace: torch.Tensor) -> None:
    assert mb.routed_experts is not None and mb.routing_valid is not None
    n, packed = trace.shape[0], mb.routed_experts[c0:c1]
    assert packed.dtype == trace.dtype
    assert torch.equal(packed[:n], trace)
    assert mb.routing_valid[c0:c1].tolist() == [True] * n + [False] * (c1 - c0 - n)
    if n == c1 - c0 - 1 and n > 0:
        assert torch.equal(packed[n], trace[n - 1])  # filler repeats the previous row


def _check_packing(batch: TrajectoryBatch, mbs: list[MicroBatch], budget: int) -> None:
    seen: list[int] = []
    for mb in mbs:
        assert 0 < mb.num_tokens <= budget
        assert torch.equal(
            mb.input_ids[mb.response_positions], batch.response_ids[mb.response_token_index].long()
        )
        assert torch.equal(mb.rollout_logp, batch.rollout_logp[mb.response_token_index])
        for k, i in enumerate(mb.sample_indices.tolist()):
            _check_sample(mb, k, batch.sample(i))
        seen += mb.sample_indices.tolist()
    assert sorted(seen) == list(range(batch.num_samples))


@pytest.mark.parametrize(
    ("seed", "routing", "budget"),
    [
        pytest.param(0, (3, 2, 16), 16, id="uint8-routing-tight"),
        pytest.param(1, (2, 4, 300), 40, id="uint16-routing"),
        pytest.param(2, None, 16, id="no-routing"),
        pytest.param(3, (1, 1, 1), 100, id="one-expert-one-bin"),
    ],
)
def test_packing_keeps_fields_aligned(seed: int, routing: tuple[int, int, int] | None, budget: int) -> None:
    batch = random_batch(seed, 12, routing=routing, sampling_mask=True, old_logp=True)
    mbs = pack_microbatches(batch, budget)
    _check_packing(batch, mbs, budget)
    total = int(batch.sequence_lengths().sum())
    assert len(mbs) >= -(-total // budget)


def test_trace_without_any_row_gets_a_distinct_filler() -> None:
    sample = Sample(
        torch.tensor([3]),
        torch.tensor([], dtype=torch.int32),
        torch.tensor([]),
        0.0,
        0,
        "abort",
        [(0, 0)],
        routed_experts=torch.zeros(0, 2, 2, dtype=torch.int64),
    )
    batch = TrajectoryBatch.from_samples(
        [sample], engine="vllm", quant_recipe="bf16", policy_version=0, num_experts=4
    )
    (mb,) = pack_microbatches(batch, 4)
    assert mb.routed_experts is not None and mb.routed_experts.tolist() == [[[0, 1], [0, 1]]]
    assert mb.routing_valid is not None and mb.routing_valid.tolist() == [False]


def test_over_budget_sample_is_named_not_dropped() -> None:
    batch = random_batch(4, 6, max_prompt_len=4, max_response_len=4)
    longest = int(batch.sequence_lengths().argmax())
    budget = int(batch.sequence_lengths().max()) - 1
    with pytest.raises(TrajectoryError) as err:
        pack_microbatches(batch, budget)
    assert err.value.field == "max_tokens_per_microbatch" and err.value.sample == longest
    assert f"sample {longest}" in str(err.value)


def test_plan_first_fit_decreasing() -> None:
    assert plan_microbatches([5, 5, 5], 10) == [[0, 1], [2]]
    assert plan_microbatches([2, 9, 3, 7, 1], 10) == [[0], [1, 4], [2, 3]]
    assert plan_microbatches([], 10) == []


def test_plan_exact_microbatch_count() -> None:
    plan = plan_microbatches([1, 1, 1, 1, 1], 100, num_microbatches=3)
    assert len(plan) == 3 and sorted(i for b in plan for i in b) == [0, 1, 2, 3, 4]
    with pytest.raises(TrajectoryError, match="num_microbatches.*more micro-batches"):
        plan_microbatches([6, 6, 6], 10, num_microbatches=2)
    with pytest.raises(TrajectoryError, match="fewer samples than micro-batches"):
        plan_microbatches([1, 1], 10, num_microbatches=3)


def test_pack_with_fixed_count_stays_aligned() -> None:
    batch = random_batch(5, 9, routing=(2, 2, 8), sampling_mask=True)
    mbs = pack_microbatches(batch, 64, num_microbatches=4)
    assert len(mbs) == 4
    _check_packing(batch, mbs, 64)


def test_split_balanced_covers_and_balances() -> None:
    batch = random_batch(6, 31, max_prompt_len=20, max_response_len=30)
    shards = split_balanced(batch, 4)
    assert sorted(torch.cat(shards).tolist()) == list(range(31))
    loads = [int(batch.sequence_lengths()[s].sum()) for s in shards]
    assert max(loads) - min(loads) <= int(batch.sequence_lengths().max())
    assert all(s.numel() > 0 for s in shards)
    assert batch.select(shards[0]).num_samples == shards[0].numel()


def test_split_balanced_needs_enough_samples() -> None:
    with pytest.raises(TrajectoryError, match="num_shards"):
        split_balanced(random_batch(7, 2), 3)
