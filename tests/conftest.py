"""Test tiers, the device parametrization and the CI rule.

* Devices: a test that takes the ``device`` fixture (or a module that marks
  ``pytest.mark.usefixtures("device")``) runs once per device, ``[cpu]`` and ``[cuda]``; the
  ``[cuda]`` variant is marked ``gpu``. A process computes on one device (`moe_rl.device`): the
  ``[cuda]`` variants run where CUDA is present, the ``[cpu]`` variants where it is not, and the
  other variant is skipped with the reason. So ``pytest -m gpu`` is the GPU tier, and on a CPU
  machine the suite runs as before.
* CI rule: in CI (CI=true), a skipped test marked `slurm` or `e2e` is a failure, so those tiers can
  never silently stop running — unless it is a ``gpu`` test on a machine without CUDA. A file or
  folder skipped whole at collection (a module-level ``pytest.importorskip`` whose library failed to
  install, a conftest that skips its folder) fails the run too, named at the end: otherwise its
  tests would vanish from the count without a skip to see.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import pytest

REQUIRED_IN_CI = ("slurm", "e2e")
DEVICES = ("cpu", "cuda")


@functools.cache
def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        params = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
        metafunc.parametrize("device", params, indirect=True)


@pytest.fixture
def device(request: pytest.FixtureRequest):
    """The device the test's models and tensors live on: ``cpu`` or ``cuda`` (see above)."""
    import torch

    if request.param == "cuda":  # the process's own GPU, with its index, as tensors report it
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _gpus_visible_again():
    """A command run in this process (``main([...])``) may hide the GPUs for its own run
    (`moe_rl.device.hide_cuda_if_cpu`); the next test, and the processes it starts, see them again."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    if before is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = before


SHARED_RAY_CPUS = 8
"""CPUs the shared Ray cluster offers: the largest test run's processes (two trainer ranks, two
engines, the reward worker) fit, whatever the machine's core count."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator:
    """One Ray cluster on this machine that `moe-rl train` runs join through ``RAY_ADDRESS``, as the
    runs of a Slurm job join the job's: its processes start with the runs' process environment
    (`moe_rl.orchestration.placement.PROCESS_ENV`), and each run brings its own settings in its job's
    runtime env (`moe_rl.orchestration.ray_cluster.start_ray`). The end-to-end tier's runs share it
    (tests/e2e/conftest.py), so each run pays its actors' start, not a cluster's."""
    from ray.cluster_utils import Cluster

    from moe_rl.orchestration.placement import PROCESS_ENV

    with pytest.MonkeyPatch.context() as env:  # read by the cluster's processes as they start
        for key, value in PROCESS_ENV.items():
            env.setenv(key, value)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": SHARED_RAY_CPUS,
                "object_store_memory": 2 << 30,
                "include_dashboard": False,
            },
        )
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


_SKIPPED_AT_COLLECTION: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and _in_ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED_AT_COLLECTION.append(f"{report.nodeid}: {reason.removeprefix('Skipped: ')}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _SKIPPED_AT_COLLECTION:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "skipped whole at collection: not allowed in CI", red=True)
        for line in _SKIPPED_AT_COLLECTION:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _has_cuda()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_cpu = pytest.mark.skip(
        reason="this process sees CUDA, so its models run there; the [cpu] variant runs on a machine "
        "without CUDA (or with CUDA_VISIBLE_DEVICES=)"
    )
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not has_cuda and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)
        elif has_cuda and params.get("device") == "cpu":
            item.add_marker(skip_cpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    # markers, not keywords: keywords also hold folder names (everything under tests/e2e/)
    required = [m for m in REQUIRED_IN_CI if item.get_closest_marker(m)]
    no_gpu_here = item.get_closest_marker("gpu") is not None and not _has_cuda()
    if report.skipped and required and _in_ci() and not no_gpu_here:
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"a `{required[0]}` test may not skip in CI: {reason}"
