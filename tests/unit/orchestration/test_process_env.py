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
    from moe_rl.orchestration.ray_cluster import start_ray

    for key in (*PROCESS_ENV, "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)  # as a user's shell: restored after the test

    def initial_environment() -> list[str]:  # (a local function travels by value to the worker)
        with open("/proc/self/environ", "rb") as f:  # what the process was started with
            return [entry.decode() for entry in f.read().split(b"\0") if entry]

    start_ray(load_checked(TINY))
    assert ray.is_initialized()
    try:
        started_with = ray.get(ray.remote(initial_environment).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert {f"{key}={value}" for key, value in PROCESS_ENV.items()} <= set(started_with)


def test_a_run_joining_a_cluster_brings_its_log_folder_settings_and_module_path(
    ray_cluster, monkeypatch, tmp_path, capfd
):
    """A joined cluster's processes were started by others (a Slurm job's nodes, the tests' shared
    cluster): the run's log folder, its ``MOE_RL_*`` settings and the PYTHONPATH its preflight found
    the user's modules on reach its workers through the job's runtime env, and nothing else of the
    driver's environment does. What a worker prints to stderr (the project's warnings, a crash)
    reaches the run's terminal, as in a local run."""
    import time

    ray = pytest.importorskip("ray")
    from moe_rl.log import LOG_DIR_ENV
    from moe_rl.orchestration.faults import FAULTS_ENV
    from moe_rl.orchestration.ray_cluster import start_ray

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    monkeypatch.setenv(FAULTS_ENV, "die_in_generate=9@9")
    monkeypatch.setenv("NOT_THE_PROJECTS", "1")
    (tmp_path / "users_module.py").write_text("ANSWER = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    marker = f"a worker's line {tmp_path.name}"

    def environment() -> dict[str, str]:
        import os
        import sys

        import users_module  # on the driver's PYTHONPATH only

        print(marker, file=sys.stderr, flush=True)
        return {**os.environ, "answer": str(users_module.ANSWER)}

    start_ray(load_checked(TINY), tmp_path / "logs")
    assert ray.is_initialized()
    printed = ""
    try:
        seen = ray.get(ray.remote(environment).remote(), timeout=120)
        deadline = time.monotonic() + 60  # Ray forwards a worker's output about once a second
        while marker not in printed and time.monotonic() < deadline:
            time.sleep(0.2)
            printed += capfd.readouterr().err
    finally:
        ray.shutdown()
    assert seen[FAULTS_ENV] == "die_in_generate=9@9"
    assert seen[LOG_DIR_ENV] == str((tmp_path / "logs").resolve())
    assert seen["answer"] == "42"
    assert "NOT_THE_PROJECTS" not in seen
    assert {key: seen.get(key) for key in PROCESS_ENV} == PROCESS_ENV  # the cluster's own start
    assert marker in printed
