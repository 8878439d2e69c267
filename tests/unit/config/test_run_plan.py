"""The run's plan (`moe_rl.config.run_plan`): the decisions every rank and engine of a run follows,
made once from the recipe and the device, and frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moe_rl.config import load_recipe
from moe_rl.config.modes import SyncRoute
from moe_rl.config.run_plan import run_plan

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def test_the_plan_holds_the_device_the_sync_route_and_the_memory_release_and_is_frozen():
    config = load_recipe(TINY)
    plan = run_plan(config, "cpu")
    assert (plan.device, plan.sync.route, plan.releases_memory) == ("cpu", SyncRoute.BUCKETS, False)
    assert run_plan(config, "cpu", in_process=True).sync.route == SyncRoute.IN_PROCESS
    assert run_plan(config, "cuda").releases_memory  # colocated on CUDA, synchronous: `auto` releases
    assert not run_plan(load_recipe(TINY, ["run.mode=async"]), "cuda").releases_memory
    assert run_plan(load_recipe(TINY, ["cluster.release_memory=on"]), "cpu").releases_memory
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.releases_memory = True


def test_a_route_that_cannot_work_is_refused_naming_its_key():
    config = load_recipe(TINY, ["rollout.sync_transport=device_ipc"])
    with pytest.raises(ValueError, match="rollout.sync_transport=device_ipc"):
        run_plan(config, "cpu")
