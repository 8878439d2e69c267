"""Ray seats a colocated layout: a local two-node Ray cluster that declares four GPUs per node
(`ray.cluster_utils.Cluster`; no GPU is touched), the placement of a colocated recipe on it
(8 trainer ranks, 4 engines of tensor parallelism 2), and actors seated with exactly the options
the trainer group and the engine pool use (`moe_rl.orchestration.seats.Seats`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from moe_rl.config.derived import PlacementMode
from moe_rl.config.loader import load_recipe
from moe_rl.device import Machine
from moe_rl.orchestration.placement import TRAINER_NODE, placement_rules, plan_placement
from moe_rl.orchestration.seats import Seats

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"
COLOCATED = [
    "parallel.trainer_world_size=8", "parallel.expert_model_parallel_size=8", "rollout.num_engines=4",
    "rollout.tensor_parallel_size=2", "cluster.nodes=2", "cluster.trainer_nodes=2", "cluster.rollout_nodes=0",
    "cluster.gpus_per_node=4",
]  # fmt: skip


@ray.remote(num_cpus=0)
class Seated:
    """Where an actor sits: its node, and the GPUs Ray gave it."""

    def __init__(self, visible: list[str] | None = None):
        if visible:  # as the engine actor does
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)

    def where(self) -> tuple[str, list[str], str]:
        gpus = [str(i) for i in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), gpus, os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_a_colocated_layout_seats_each_rank_and_engine_share_on_the_same_gpus():
    from ray.cluster_utils import Cluster

    config = load_recipe(TINY, COLOCATED)
    assert not [r for r in placement_rules(config) if r.broken and r.fatal]
    placement = plan_placement(config, Machine(cuda=True, capability=(9, 0)), node_roles=True)
    assert placement.mode == PlacementMode.COLOCATED and placement.shares_gpus
    assert placement.trainer_bundle()["GPU"] == 1.0 and placement.trainer_gpus + placement.engine_gpus == 1.0
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 6, "num_gpus": 4, "resources": {TRAINER_NODE: 1}},
    )
    try:
        cluster.add_node(num_cpus=6, num_gpus=4, resources={TRAINER_NODE: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        seats = Seats(placement)
        seats.reserve_trainer()
        ranks = [Seated.options(**seats.trainer_options(r)).remote() for r in range(8)]
        engines = [
            Seated.options(**seats.engine_options(j, colocated_roles=True)).remote(seats.visible_gpus(j))
            for j in range(4)
        ]
        rank_at = ray.get([r.where.remote() for r in ranks])
        engine_at = ray.get([e.where.remote() for e in engines])
        # the ranks of a node fill its four GPUs, one each; the two nodes hold four ranks each
        assert len({node for node, _, _ in rank_at}) == 2
        for first in (0, 4):
            node = rank_at[first][0]
            assert all(rank_at[r][0] == node for r in range(first, first + 4))
            gpus = sorted(gpu for r in range(first, first + 4) for gpu in rank_at[r][1])
            assert gpus == ["0", "1", "2", "3"]
        for j, (node, gpus, visible) in enumerate(engine_at):
            span = [rank_at[2 * j][1][0], rank_at[2 * j + 1][1][0]]
            assert node == rank_at[2 * j][0] == rank_at[2 * j + 1][0]  # an engine spans GPUs of one node
            assert gpus == [span[0]] and visible == ",".join(span)  # its own GPU first, then the span's
        assert ray.available_resources().get("GPU", 0.0) == 0.0  # every GPU reserved by its bundle
        seats.release()
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["rollout.tensor_parallel_size=8", "rollout.num_engines=1"], "colocated engine within a node"),
        (["rollout.num_engines=2"], "colocated GPUs all generate"),
    ],
)
def test_colocated_layouts_that_cannot_share_every_gpu_are_named(overrides, rule):
    config = load_recipe(TINY, [*COLOCATED, *overrides])
    broken = [r for r in placement_rules(config) if not r.ok]
    assert [r.name for r in broken] == [rule]
    assert broken[0].fatal == (rule == "colocated engine within a node")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.release_memory=on", "cluster.nodes=2", "cluster.rollout_nodes=1"],
         "cluster.release_memory=on, cluster.rollout_nodes=1: only engines on the"),
        (["cluster.release_memory=on", "run.mode=async"], "cluster.release_memory=on with run.mode=async: memory is given back only"),
        (["cluster.engine_sleep_level=3"], "cluster.engine_sleep_level=3: 1"),
        (["cluster.release_memory=on"], "has no sleep mode, needed by cluster.release_memory=on"),
    ],
)  # fmt: skip
def test_memory_release_that_cannot_work_is_refused_before_anything_starts(overrides, message):
    from moe_rl.errors import ConfigError
    from moe_rl.orchestration.preflight import load_checked

    recipe = TINY.with_name("tiny_moe_vllm.yaml") if "sleep mode" in message else TINY
    with pytest.raises(ConfigError, match=message):
        load_checked(recipe, overrides, Machine(cuda=False))
