"""Test tiers and the CI rule: in CI (CI=true), a skipped test marked `slurm` or `e2e` is a
failure, so those tiers can never silently stop running. `gpu` tests skip where no CUDA device is
present."""

from __future__ import annotations

import os

import pytest

REQUIRED_IN_CI = ("slurm", "e2e")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    # markers, not keywords: keywords also hold folder names (everything under tests/e2e/)
    required = [m for m in REQUIRED_IN_CI if item.get_closest_marker(m)]
    if report.skipped and required and _in_ci():
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"a `{required[0]}` test may not skip in CI: {reason}"
