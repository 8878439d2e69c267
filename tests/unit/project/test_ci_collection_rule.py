"""The CI rule of tests/conftest.py also covers what is skipped before any test is seen: a test
file whose module-level `pytest.importorskip` fails (its library did not install) fails a CI run,
named at the end, while the other files' tests still run; outside CI it is an ordinary skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _suite(tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    root.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", root / "conftest.py")
    (root / "test_gone.py").write_text(
        'import pytest\npytest.importorskip("no_such_library_here")\n\ndef test_never_seen():\n    pass\n'
    )
    (root / "test_here.py").write_text("def test_runs():\n    assert True\n")
    return root


def _pytest(root: Path, ci: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": ci}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)],
        cwd=root, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_a_file_skipped_at_collection_fails_a_ci_run(tmp_path):
    root = _suite(tmp_path)
    ci = _pytest(root, "true")
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "skipped whole at collection: not allowed in CI" in ci.stdout
    assert "test_gone.py: could not import 'no_such_library_here'" in ci.stdout
    assert "1 passed" in ci.stdout  # the other files still ran
    local = _pytest(root, "")
    assert local.returncode == 0 and "1 passed, 1 skipped" in local.stdout, local.stdout[-2000:]
