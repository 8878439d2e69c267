"""Dispatch over engine replicas, merging back in prompt order, data-parallel shards with equal
micro-batch counts, and placement rules: pure functions, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import load_recipe
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.packing import plan_shards
from moe_rl.data.synthetic import random_batch
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.device import Machine
from moe_rl.orchestration.batches import validate_and_plan
from moe_rl.orchestration.dispatch import dispatch, merge
from moe_rl.orchestration.placement import (
    SHARED_GPU,
    placement_lines,
    placement_rules,
    plan_placement,
)
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rules import first_broken

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"
KIMI = TINY.parent / "kimi_k2.yaml"


def test_dispatch_balances_token_load_and_keeps_a_prompts_samples_together():
    lengths = [30, 2, 2, 2, 10, 10, 3, 1]
    plan = dispatch(lengths, n=4, max_new_tokens=6, replicas=3)
    assert sorted(p for a in plan.assignment for p in a) == list(range(8))  # each prompt exactly once
    loads = [sum(4 * (lengths[p] + 6) for p in a) for a in plan.assignment]
    assert plan.assignment[0] == [0]  # the longest prompt alone on one replica
    assert max(loads[1:]) - min(loads[1:]) <= 4 * (3 + 6)  # the rest balanced within one prompt
    assert all(a == sorted(a) for a in plan.assignment)
    assert dispatch([5], n=2, max_new_tokens=3, replicas=2).assignment == [[0], []]
    with pytest.raises(ValueError, match="rollout.num_engines=0"):
        dispatch(lengths, 4, 6, replicas=0)


def _replica_batch(prompts: list[int], n: int) -> TrajectoryBatch:
    """Samples whose prompt token is the global prompt index (to check the merge order)."""
    batch = random_batch(len(prompts), len(prompts) * n, max_prompt_len=3, max_response_len=3, group_size=n)
    rows = [torch.full((1 + k % 2,), p, dtype=torch.int32) for p in prompts for k in range(n)]
    ids = torch.cat(rows)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([len(r) for r in rows]).cumsum(0)
    return batch.replace(prompt_ids=ids, prompt_offsets=offsets)


def test_merge_puts_the_replicas_samples_in_prompt_order():
    plan = dispatch([4, 9, 1, 7, 7, 2], n=2, max_new_tokens=4, replicas=3)
    parts = [_replica_batch(a, 2) if a else None for a in plan.assignment]
    merged = merge(parts, plan)
    firsts = [int(merged.sample(i).prompt_ids[0]) for i in range(merged.num_samples)]
    assert firsts == [p for p in range(6) for _ in range(2)]


def test_shards_keep_each_mini_batch_and_share_its_micro_batch_count():
    batch = random_batch(3, 24, max_prompt_len=8, max_response_len=8)
    plan = plan_shards(batch, dp_size=2, max_tokens_per_microbatch=40, num_mini_batches=2)
    assert sorted(torch.cat(plan.indices).tolist()) == list(range(24))
    for rank, idx in enumerate(plan.indices):  # mini-batch 0 = samples 0..11, 1 = 12..23, on every rank
        first = idx[: plan.samples[rank][0]]
        assert (first < 12).all() and (idx[plan.samples[rank][0] :] >= 12).all()
    lengths = batch.sequence_lengths()
    tokens = [int(lengths[idx].sum()) for idx in plan.indices]
    assert abs(tokens[0] - tokens[1]) <= 2 * int(lengths.max())
    assert len(plan.micro_batches) == 2 and all(m >= 1 for m in plan.micro_batches)
    assert plan.rank(1).micro_batches == plan.micro_batches
    one = plan_shards(batch, dp_size=1, max_tokens_per_microbatch=40, num_mini_batches=2)
    assert one.indices[0].tolist() == list(range(24)) and one.samples == [[12, 12]]
    with pytest.raises(TrajectoryError, match="every data-parallel rank needs a sample in every mini-batch"):
        plan_shards(random_batch(4, 4), dp_size=2, max_tokens_per_microbatch=40, num_mini_batches=3)


def test_validate_and_plan_scores_and_refuses_stale_batches_without_sharding():
    batch = random_batch(5, 8, group_size=2)
    newest = int(batch.version_span_versions.max())
    _, fresh = validate_and_plan(batch, [1.0] * 8, version=newest, max_staleness=newest, vocab_size=64, dp_size=2,
                       max_tokens_per_microbatch=64, num_mini_batches=1)  # fmt: skip
    assert fresh.stale is None and len(fresh.plan.indices) == 2 and fresh.rewards.tolist() == [1.0] * 8
    _, stale = validate_and_plan(batch, [0.0] * 8, version=newest + 9, max_staleness=1, vocab_size=64, dp_size=2,
                       max_tokens_per_microbatch=64, num_mini_batches=1)  # fmt: skip
    assert "older than allowed" in stale.stale and stale.plan is None


def test_placement_follows_the_device_and_the_cluster():
    tiny = load_checked(TINY, ["parallel.trainer_world_size=2", "rollout.num_engines=2"])
    cpu = plan_placement(tiny, Machine(cuda=False))
    assert (cpu.device, cpu.trainer_ranks, cpu.trainer_gpus, cpu.engines) == ("cpu", 2, 0.0, 2)
    assert cpu.mode == "colocated"  # cluster.rollout_nodes=0: engines on the trainer's nodes, on CPU too
    assert cpu.trainer_bundle() == {"CPU": 1.0} and cpu.threads("trainer", 8) == 4
    one_gpu = plan_placement(load_checked(TINY), Machine(cuda=True))
    assert one_gpu.trainer_gpus == one_gpu.engine_gpus == SHARED_GPU
    kimi = plan_placement(load_checked(KIMI, paths=False), Machine(cuda=True), node_roles=True)
    assert kimi.trainer_bundle() == {"CPU": 1.0, "GPU": 1.0, "moe_rl_trainer_node": 0.001}
    assert kimi.engine_bundle(colocated=False) == {"CPU": 1.0, "GPU": 16.0, "moe_rl_rollout_node": 0.001}


def test_placement_rules_name_what_does_not_fit():
    kimi = load_recipe(KIMI)
    names = {r.name: r for r in placement_rules(kimi)}
    assert all(r.ok for r in names.values()) and "engine GPUs" in names
    with pytest.raises(ValueError, match=r"engine GPUs: .* 9 x 16 = 144 GPUs, 128 on cluster.rollout_nodes"):
        first_broken(placement_rules(load_recipe(KIMI, ["rollout.num_engines=9"])))
    two_ranks = load_recipe(TINY, ["parallel.trainer_world_size=2"])
    first_broken(placement_rules(two_ranks, Machine(cuda=False)))
    with pytest.raises(ValueError, match="without a GPU count the run gets one GPU"):
        first_broken(placement_rules(two_ranks, Machine(cuda=True)))
    lines = placement_lines(load_checked(KIMI, paths=False))
    assert lines == [
        "trainer: 384 ranks on 48 node(s) (nodes 0..47), 8 per node, 1 GPU each",
        "rollout: 8 engine(s) on 16 node(s) (nodes 48..63), 16 GPUs each, spanning 2 nodes",
    ]
