"""pytest plugin of scripts/mutate.py's unmutated run: each test in its own coverage context (its
node id), and each test's time written to ``$MUTATE_DURATIONS`` at the end."""

from __future__ import annotations

import json
import os
import time

import coverage
import pytest

_durations: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
    item.stash[_start] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    cov = coverage.Coverage.current()
    if cov is not None and nextitem is None:
        cov.switch_context("")


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start = time.monotonic()
    yield
    _durations[item.nodeid] = time.monotonic() - start


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("MUTATE_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump(_durations, f)


_start = pytest.StashKey[float]()
