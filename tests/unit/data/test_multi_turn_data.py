"""Multi-turn trajectories in the data layer: the ``sampled`` field through building, selecting,
validation, packing and shards; single-turn shards written before the field existed still load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.data.errors import TrajectoryError
from moe_rl.data.packing import pack_samples
from moe_rl.data.shards import read_shards, write_shards
from moe_rl.data.synthetic import random_batch
from moe_rl.data.trajectory import TrajectoryBatch, first_difference
from moe_rl.data.validate import validate

OLD_SHARDS = Path(__file__).resolve().parents[2] / "data" / "shards_single_turn"
ROUTING = (2, 2, 8)


def _batch(seed: int = 0) -> TrajectoryBatch:
    batch = random_batch(seed, 6, max_response_len=8, routing=ROUTING, sampling_mask=True, env_tokens=True)
    assert not bool(batch.sampled.all())
    return batch


def _first_env_token(batch: TrajectoryBatch) -> tuple[int, int, int]:
    """(flat index, sample, token within the response) of the first environment token."""
    flat = int((~batch.sampled).nonzero()[0, 0])
    sample = int(torch.searchsorted(batch.response_offsets, torch.tensor([flat]), right=True)[0]) - 1
    return flat, sample, flat - int(batch.response_offsets[sample])


def test_views_and_concat_carry_sampled():
    batch = _batch()
    validate(batch)
    assert batch.sampled_lengths().tolist() == [int(s.sampled.sum()) for s in batch.samples()]
    picked = batch.select([4, 1, 1])
    assert torch.equal(picked.sampled, torch.cat([batch.sample(i).sampled for i in (4, 1, 1)]))
    assert torch.equal(batch.slice(2, 5).sampled, torch.cat([batch.sample(i).sampled for i in (2, 3, 4)]))
    assert first_difference(TrajectoryBatch.concat([batch.slice(0, 3), batch.slice(3, 6)]), batch) is None
    single = random_batch(1, 2, routing=ROUTING, sampling_mask=True)
    assert single.sampled is None and bool(single.sampled_mask().all())
    with pytest.raises(TrajectoryError, match="sampled"):
        TrajectoryBatch.concat([batch, single])


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ("nan_on_sampled", "rollout_logp", "missing log-prob"),
        ("logp_on_env", "rollout_logp", "environment token"),
        ("kept_on_env", "sampling_mask_ids", "kept set on an environment token"),
        ("no_sampled", "sampled", "no sampled token"),
        ("wrong_dtype", "sampled", "wrong dtype"),
        ("wrong_length", "sampled", "length differs"),
        ("short_trace", "routing_offsets", "wrong routing trace length"),
    ],
)
def test_bad_multi_turn_fields_are_named_errors(change, field, problem):
    batch = _batch()
    flat, sample, _token = _first_env_token(batch)
    if change == "nan_on_sampled":
        logp = batch.rollout_logp.clone()
        logp[int(batch.sampled.nonzero()[0, 0])] = float("nan")
        batch = batch.replace(rollout_logp=logp)
    elif change == "logp_on_env":
        logp = batch.rollout_logp.clone()
        logp[flat] = -0.5
        batch = batch.replace(rollout_logp=logp)
    elif change == "kept_on_env":
        offsets = batch.sampling_mask_offsets.clone()
        ids = torch.cat([batch.sampling_mask_ids[: offsets[flat]], torch.tensor([3], dtype=torch.int32),
                         batch.sampling_mask_ids[offsets[flat] :]])  # fmt: skip
        offsets[flat + 1 :] += 1
        batch = batch.replace(sampling_mask_ids=ids, sampling_mask_offsets=offsets)
    elif change == "no_sampled":
        s = batch.sampled.clone()
        r0, r1 = int(batch.response_offsets[sample]), int(batch.response_offsets[sample + 1])
        s[r0:r1] = False
        logp = batch.rollout_logp.clone()
        logp[r0:r1] = float("nan")
        ids, offsets = batch.sampling_mask_ids, batch.sampling_mask_offsets
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        keep[int(offsets[r0]) : int(offsets[r1])] = False
        lengths = offsets[1:] - offsets[:-1]
        lengths[r0:r1] = 0
        new_offsets = torch.zeros_like(offsets)
        new_offsets[1:] = torch.cumsum(lengths, 0)
        batch = batch.replace(sampled=s, rollout_logp=logp, sampling_mask_ids=ids[keep],
                              sampling_mask_offsets=new_offsets)  # fmt: skip
    elif change == "wrong_dtype":
        batch = batch.replace(sampled=batch.sampled.to(torch.uint8))
    elif change == "wrong_length":
        batch = batch.replace(sampled=batch.sampled[:-1])
    elif change == "short_trace":
        lengths = batch.routing_lengths()
        lengths[sample] -= 2  # the trace must cover environment tokens like every other position
        offsets = torch.zeros_like(batch.routing_offsets)
        offsets[1:] = torch.cumsum(lengths, 0)
        rows = torch.cat([batch.routed_experts[int(a) : int(a) + int(n)]
                          for a, n in zip(batch.routing_offsets[:-1], lengths, strict=True)])  # fmt: skip
        batch = batch.replace(routed_experts=rows, routing_offsets=offsets)
    with pytest.raises(TrajectoryError, match=problem) as err:
        validate(batch)
    assert err.value.field == field


def test_packing_keeps_environment_tokens_as_context():
    batch = _batch(3)
    micro = pack_samples(batch, torch.arange(batch.num_samples))
    assert micro.num_tokens == int(batch.sequence_lengths().sum())
    assert micro.response_positions.numel() == int(batch.sampled.sum())
    assert torch.equal(micro.response_token_index, batch.sampled.nonzero().flatten())
    assert torch.equal(micro.rollout_logp, batch.rollout_logp[batch.sampled])
    assert (
        micro.response_offsets[1:] - micro.response_offsets[:-1]
    ).tolist() == batch.sampled_lengths().tolist()
    # every kept-set row the micro-batch carries belongs to a sampled token
    assert micro.sampling_mask_offsets.numel() == micro.response_positions.numel() + 1
    assert bool(((micro.sampling_mask_offsets[1:] - micro.sampling_mask_offsets[:-1]) > 0).all())
    # the input holds environment tokens where they were written
    flat, sample, token = _first_env_token(batch)
    start = int(micro.cu_seqlens[sample]) + int(batch.prompt_lengths()[sample]) + token
    assert int(micro.input_ids[start]) == int(batch.response_ids[flat]) and not bool(micro.loss_mask[start])


def test_shards_round_trip_sampled_and_old_shards_still_load(tmp_path):
    batch = _batch(7)
    write_shards([batch], tmp_path / "multi", max_samples_per_shard=4)
    back = TrajectoryBatch.concat(list(read_shards(tmp_path / "multi")))
    assert first_difference(back, batch) is None

    old = list(read_shards(OLD_SHARDS, vocab_size=16, num_experts=8, topk=2))
    assert len(old) == 1 and old[0].num_samples == 3 and old[0].sampled is None
    assert old[0].has_routing and old[0].has_sampling_mask
    assert bool(torch.isfinite(old[0].rollout_logp).all())
