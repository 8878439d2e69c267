"""Engines whose weight stream broke (a process of the stream's group died, they live on with part
of the new weights) are synced again by the pool, a bounded number of times in a row; real Ray
actors stand for the engines' finish of a sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from moe_rl.config.derived import PlacementMode
from moe_rl.config.loader import load_recipe
from moe_rl.orchestration.engine_pool import MAX_ENGINE_RESTARTS, EnginePool
from moe_rl.orchestration.placement import Placement
from moe_rl.orchestration.seats import Seats
from moe_rl.weight_sync.broadcast import StreamBroken
from moe_rl.weight_sync.receiver import SyncTarget

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


@ray.remote(num_cpus=0)
class Finisher:
    """An engine's finish of a sync: its stream breaks ``breaks`` times, then it takes the version."""

    def __init__(self, breaks: int):
        self.breaks, self.finished = breaks, []

    def finish_weight_update(self, version: int, target: SyncTarget) -> dict:
        if self.breaks:
            self.breaks -= 1
            raise StreamBroken("a weight stream broke: connection closed by peer")
        self.finished.append(version)
        return {"version": version}

    def versions(self) -> list[int]:
        return self.finished


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


def _pool(breaks: list[int]) -> tuple[EnginePool, list]:
    pool = EnginePool(
        load_recipe(TINY), Seats(Placement("cpu", 1, 0.0, len(breaks), 0.0, False, PlacementMode.COLOCATED))
    )
    for replica, n in zip(pool.replicas, breaks, strict=True):
        replica.actor = Finisher.remote(n)
    again: list = []

    def sync_again(replicas, version, target) -> None:  # as the coordinator does: the sync once more
        again.append([r.index for r in replicas])
        pool.finish(version, replicas, set(), target)

    pool.on_cut_off = sync_again
    return pool, again


def test_a_cut_off_engine_is_synced_again_and_the_others_are_left_alone(local_ray):
    pool, again = _pool([0, 1])
    assert pool.finish(7, pool.replicas, set(), SyncTarget.ENGINE) == {"version": 7}
    assert again == [[1]]  # only the engine whose stream broke
    assert [ray.get(r.actor.versions.remote()) for r in pool.replicas] == [[7], [7]]
    assert pool.restarts == 0  # it lived: not restarted


def test_a_stream_that_keeps_breaking_stops_the_run_with_the_reason(local_ray):
    pool, again = _pool([0, MAX_ENGINE_RESTARTS + 5])
    with pytest.raises(RuntimeError, match=r"engine replicas 1 broke 3 times in a row.*connection closed"):
        pool.finish(7, pool.replicas, set(), SyncTarget.ENGINE)
    assert again == [[1]] * MAX_ENGINE_RESTARTS
