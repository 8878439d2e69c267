"""A local run's Ray processes start with the run's process environment (`placement.PROCESS_ENV`):
the settings that a process reads only when it starts (glibc's copy setting) are in its initial
environment, not set later."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.orchestration.placement import PROCESS_ENV
from moe_rl.orchestration.preflight import load_checked

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def test_a_local_run_s_ray_processes_start_with_the_process_env(monkeypatch):
    ray = pytest.importorskip("ray")
    from moe_rl.orchestration.actors import start_ray

    for key in (*PROCESS_ENV, "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)  # as a user's shell: restored after the test

    def initial_environment() -> list[str]:  # (a local function travels by value to the worker)
        with open("/proc/self/environ", "rb") as f:  # what the process was started with
            return [entry.decode() for entry in f.read().split(b"\0") if entry]

    assert start_ray(load_checked(TINY))
    try:
        started_with = ray.get(ray.remote(initial_environment).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert {f"{key}={value}" for key, value in PROCESS_ENV.items()} <= set(started_with)
