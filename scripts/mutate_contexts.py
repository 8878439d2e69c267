"""pytest plugin of scripts/mutate.py's unmutated run: each test in its own coverage context (its
node id), in this process and in every Python process it starts meanwhile (coverage's
``patch = subprocess`` hands them its settings in ``COVERAGE_PROCESS_CONFIG``: the test's node id,
marked `STARTED_BY`, goes in as their static context), and each test's time written to ``$MUTATE_DURATIONS`` at the end."""

from __future__ import annotations

import base64
import json
import os
import time

import coverage
import pytest

_durations: dict[str, float] = {}
STARTED_BY = " (a process it started)"
"""Appended to the context of lines run in a process a test started: such a process often serves a
module's shared fixture, whose outputs other tests of the file check (`mutate.py` runs them all)."""
_CHILDREN = "COVERAGE_PROCESS_CONFIG"
_children_config = os.environ.get(_CHILDREN)


def _children_context(nodeid: str) -> None:
    """The coverage context of the processes started from now on (coverage's serialized settings:
    base64 of a JSON object; left as they are if that ever changes)."""
    if _children_config is None:
        return
    try:
        settings = json.loads(base64.b64decode(_children_config))
    except ValueError:
        return
    settings["context"] = f"{nodeid}{STARTED_BY}" if nodeid else None
    os.environ[_CHILDREN] = base64.b64encode(json.dumps(settings).encode()).decode()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
    _children_context(item.nodeid)
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
    _children_context("")


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
