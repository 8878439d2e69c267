"""The end-to-end tier's runs join one Ray cluster (the session's `ray_cluster`, tests/conftest.py)
instead of each starting its own: ``RAY_ADDRESS`` is set for the whole tier, and every run the tier
starts inherits it. A test of the local start itself (the README's path: a run's own cluster, its
start interrupted, its processes gone afterwards) runs without it (`tests.e2e.runs.own_ray_env`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.runs import LEARN_STEPS, REPO, own_ray_env, train_tiny


@pytest.fixture(scope="package", autouse=True)
def _runs_join_the_shared_ray_cluster(ray_cluster) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_cluster.address)
        yield


ASYNC_RUN = [
    "run.steps=4", "run.mode=async", "run.max_staleness=2", "run.async_depth=2", "rollout.num_engines=2",
    "algo.zero_variance_shaping=true", "rollout.inflight_updates=true", "rollout.top_p=0.9",
    "logging.diagnose_every=1",
]  # fmt: skip
"""Asynchronous, two steps ahead with staleness bound 2, in-flight weight updates and two engines,
shaping zero-variance groups, top-p 0.9 and the mismatch probe every step."""


@pytest.fixture(scope="package")
def async_run(tmp_path_factory) -> Path:
    """One finished run of `ASYNC_RUN` for the tests that read it (the staleness bound, the report)."""
    root = tmp_path_factory.mktemp("async")
    train_tiny(root, "async", *ASYNC_RUN)
    return root / "async"


@dataclass(frozen=True)
class FinishedRun:
    path: Path
    out: str
    """What the command printed (its stdout and stderr, as a terminal shows them)."""


@pytest.fixture(scope="package")
def learned_run(tmp_path_factory) -> FinishedRun:
    """The README's command, for `LEARN_STEPS` steps: the run starts a Ray cluster of its own (the
    tier's other runs join one). Its test reads what it learned and printed; the tests of a resume
    that must not go through copy its run directory (one sealed checkpoint, of the last step)."""
    root = tmp_path_factory.mktemp("learn")
    cmd = [sys.executable, "-m", "launch.cli", "train", "recipes/tiny_moe.yaml", "run.name=learn",
           f"run.steps={LEARN_STEPS}", f"run.output_dir={root}", "logging.progress=false"]  # fmt: skip
    done = subprocess.run(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        env=own_ray_env(),
    )
    assert done.returncode == 0, done.stdout[-4000:]
    return FinishedRun(root / "learn", done.stdout)
