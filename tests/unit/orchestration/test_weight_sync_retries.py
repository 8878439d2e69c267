"""The weight-sync coordinator over the Ray engine pool: engines whose weight stream broke (a
process of the stream's group died; they live on with part of the new weights) are named by the
pool's `finish` and synced again by the coordinator's loop, a bounded number of times in a row.
Real Ray actors stand for the engines' side of a sync; the trainer side streams nothing and
records which engines each attempt streamed to."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import ray

from moe_rl.config.derived import PlacementMode
from moe_rl.config.loader import load_recipe
from moe_rl.config.run_plan import run_plan
from moe_rl.orchestration.engine_pool import EnginePool
from moe_rl.orchestration.placement import Placement
from moe_rl.orchestration.seats import Seats
from moe_rl.weight_sync.broadcast import StreamBroken
from moe_rl.weight_sync.coordinator import MAX_STREAM_BREAKS, WeightSync
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


@ray.remote(num_cpus=0)
class Engine:
    """An engine's side of a sync: its stream breaks ``breaks`` times, then it takes the version."""

    def __init__(self, index: int, breaks: int):
        self.index, self.breaks, self.finished = index, breaks, []

    def begin_weight_update(self, version: int, target: SyncTarget) -> None:
        return None

    def finish_weight_update(self, version: int, target: SyncTarget) -> dict:
        if getattr(self, "dies", False):
            os._exit(1)
        if self.breaks:
            self.breaks -= 1
            raise StreamBroken("a weight stream broke: connection closed by peer")
        self.finished.append(version)
        return {"bytes_loaded": 10.0 + self.index}

    def versions(self) -> list[int]:
        return self.finished

    def break_next(self) -> None:
        self.breaks += 1

    def die_at_finish(self) -> None:
        """The process ends in the next sync's finish (as an engine killed mid-sync does)."""
        self.dies = True

    def replica(self) -> int:
        return self.index


class Streams:
    """The trainer's side: each attempt's engines, by index, and a report of one bucket."""

    def __init__(self) -> None:
        self.attempts: list[list[int]] = []
        self.whole: list[bool] = []
        """Each attempt: everything, or (a LoRA run's adapter sync) only what trains."""

    def stream_weights(self, engines: Sequence, target: SyncTarget, whole: bool = True) -> SyncReport:
        self.attempts.append(ray.get([engine.replica.remote() for engine in engines]))
        self.whole.append(whole)
        return SyncReport(bytes=100 * len(self.attempts), buckets=1, senders=1)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False)  # its own, whatever runs
    yield
    ray.shutdown()


def _sync(breaks: list[int]) -> tuple[WeightSync, EnginePool, Streams]:
    config = load_recipe(TINY)
    seats = Seats(Placement("cpu", 1, 0.0, len(breaks), 0.0, False, PlacementMode.COLOCATED))
    pool = EnginePool(config, seats, run_plan(config, "cpu"))
    for replica, n in zip(pool.replicas, breaks, strict=True):
        replica.actor = Engine.remote(replica.index, n)
    streams = Streams()
    return WeightSync(streams, pool), pool, streams


def test_a_cut_off_engine_is_synced_again_and_the_others_are_left_alone(local_ray):
    sync, pool, streams = _sync([0, 1])
    start = time.perf_counter()
    report = sync.run(7)
    assert 0 < report.seconds <= time.perf_counter() - start  # the sync's time, its retry included
    assert streams.attempts == [[0, 1], [1]]  # only the engine whose stream broke takes it again
    assert [ray.get(r.actor.versions.remote()) for r in pool.replicas] == [[7], [7]]
    assert pool.restarts == 0  # it lived: not restarted
    # the sync's report is its first attempt's, with what a receiver of it said when it finished
    assert (report.bytes, report.received) == (100, {"bytes_loaded": 10.0})
    # new engines take everything; the one whose whole sync broke takes everything again; once both
    # hold it, a sync may carry only what trains (a LoRA run's adapters), and a break keeps that so
    sync.run(8)
    assert streams.whole == [True, True, False]
    ray.get(pool.replicas[1].actor.break_next.remote())
    sync.run(9)
    assert streams.attempts[-2:] == [[0, 1], [1]] and streams.whole[-2:] == [False, False]


def test_a_stream_that_keeps_breaking_stops_the_run_with_the_reason(local_ray):
    sync, pool, streams = _sync([0, MAX_STREAM_BREAKS + 5])
    with pytest.raises(RuntimeError, match=r"engine replicas 1 broke 3 times in a row.*connection closed"):
        sync.run(7)
    assert streams.attempts == [[0, 1]] + [[1]] * MAX_STREAM_BREAKS
    assert pool.restarts == 0


class _Pool(EnginePool):
    """The pool with its restart's new process an `Engine` like the others (the real one builds a
    model; the coordinator's side of a restart is what is tested here)."""

    def _spawn(self, replica) -> None:
        replica.actor = Engine.remote(replica.index, 0)


def test_an_engine_restarted_during_an_adapter_only_sync_takes_everything_again(local_ray):
    """Once both engines hold the base, a sync carries only what trains (a LoRA run's adapters).
    Engine 1 dies in such a sync: its new process holds nothing, so the coordinator streams it the
    whole model; the next sync is adapters-only again for both."""
    config = load_recipe(TINY)
    pool = _Pool(
        config,
        Seats(Placement("cpu", 1, 0.0, 2, 0.0, False, PlacementMode.COLOCATED)),
        run_plan(config, "cpu"),
    )
    for replica in pool.replicas:
        replica.actor = Engine.remote(replica.index, 0)
    streams = Streams()
    sync = WeightSync(streams, pool)
    sync.run(7)
    first = pool.replicas[1].actor
    ray.get(first.die_at_finish.remote())
    sync.run(8)
    assert pool.restarts == 1 and pool.replicas[1].actor is not first
    assert streams.attempts == [[0, 1], [0, 1], [1]] and streams.whole == [True, False, True]
    assert ray.get(pool.replicas[1].actor.versions.remote()) == [8]
    sync.run(9)
    assert streams.attempts[-1] == [0, 1] and streams.whole[-1] is False
    assert [ray.get(r.actor.versions.remote()) for r in pool.replicas] == [[7, 8, 9], [8, 9]]
