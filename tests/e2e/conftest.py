"""The end-to-end tier's runs join one Ray cluster (the session's `ray_cluster`, tests/conftest.py)
instead of each starting its own: ``RAY_ADDRESS`` is set for the whole tier, and every run the tier
starts inherits it. A test of the local start itself (the README's path: a run's own cluster, its
start interrupted, its processes gone afterwards) runs without it (`tests.e2e.runs.own_ray_env`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package", autouse=True)
def _runs_join_the_shared_ray_cluster(ray_cluster) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_cluster.address)
        yield
