"""Weights across nodes without Ray's object store: two Ray nodes of a local multi-node cluster
(`ray.cluster_utils.Cluster`, the sbatch script's node roles as resources), the trainer group on
one and the engine pool on the other. Each sending trainer rank broadcasts its buckets in a process
group of its own with the engines (gloo), and the run is the run of the same recipe on one node,
where the buckets travel through shared memory: every step's rollouts, rewards, mismatch and
training metrics are equal, so the engines held bit-identical weights. On the two nodes engine 1
crashes as it lands a bucket of the second sync: it is restarted and brought to the weights, and
an engine whose stream broke with it is synced again, so even then the runs are equal.

The one-node run is colocated with its memory released between phases (`cluster.release_memory=on`,
engines sleeping at level 2): each step the trainer ranks move their optimizer state and gradient
buffers out once and back once, the engines drop their weights and the next sync restores them, and
the steps are still those of the two-node run.

Both runs are the expert-parallel group of the scaled-out loop (tests/e2e/test_scale_out.py): each
expert-parallel rank sends its own experts, and the steps run with R3 and keep-sampling-mask."""

from __future__ import annotations

import pytest

from moe_rl.orchestration.metrics import repeatable
from tests.e2e.runs import check_parallel_steps, train_tiny

pytestmark = pytest.mark.e2e

TRANSPORT_KEYS = ("sync/transport", "sync/shared_memory", "sync/in_place_bytes", "rollout/engine_restarts")
"""What differs by construction: how the buckets travelled, the crash."""


def _comparable(record: dict) -> dict:
    return {k: v for k, v in repeatable(record, ("memory/",)).items() if k not in TRANSPORT_KEYS}


def test_two_nodes_sync_through_a_process_group_as_one_node_does_through_shared_memory(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    from moe_rl.orchestration.placement import ROLLOUT_NODE, TRAINER_NODE

    # two trainer ranks that both send (each expert-parallel rank its own experts), two engines
    same = [
        "run.steps=3", "parallel.trainer_world_size=2", "parallel.expert_model_parallel_size=2",
        "rollout.num_engines=2",
    ]  # fmt: skip
    # the cluster's processes inherit the fault (two buckets per sync: one per sending rank)
    monkeypatch.setenv("MOE_RL_FAULTS", "die_in_sync=1@4")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {TRAINER_NODE: 1}})
    try:
        cluster.add_node(num_cpus=4, resources={ROLLOUT_NODE: 1})
        cluster.wait_for_nodes()
        monkeypatch.delenv("MOE_RL_FAULTS")
        nodes = ["cluster.nodes=2", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1"]
        apart = train_tiny(tmp_path, "apart", *same, *nodes, env={"RAY_ADDRESS": cluster.address})
    finally:
        cluster.shutdown()
    released = ["cluster.release_memory=on", "cluster.engine_sleep_level=2"]
    together = train_tiny(tmp_path, "together", *same, *released)
    assert [r["step"] for r in apart] == [r["step"] for r in together] == [0, 1, 2]
    for record in apart:
        assert record["sync/transport"] == "process_group" and record["sync/shared_memory"] == 0
        assert record["sync/senders"] == 2 and record["sync/bytes"] > 0
    assert all(r["sync/transport"] == "shared_memory" for r in together)
    for record in together:  # each phase once per step; what stays resident while the other side works
        assert record["memory/trainer_releases"] == record["memory/engine_sleeps"] == 1
        assert record["memory/trainer_generate_gib"] < record["memory/trainer_train_gib"]
        assert record["memory/engine_asleep_gib"] <= 0.1 * record["memory/engine_generate_gib"]
    assert together[-1]["memory/trainer_released_gib"] > together[0]["memory/trainer_released_gib"]  # + Adam
    assert not any(k.startswith("memory/trainer_releases") for k in apart[0])
    assert apart[-1]["rollout/engine_restarts"] == 1 and together[-1]["rollout/engine_restarts"] == 0
    for a, b in zip(apart, together, strict=True):
        assert _comparable(a) == _comparable(b), f"step {a['step']} differs"
    check_parallel_steps(together, adapters_only=False)
