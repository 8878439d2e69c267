"""Runs of `moe-rl train` on the tiny recipe for e2e tests: the real CLI in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe.yaml"


def train_tiny(tmp_path: Path, name: str, *overrides: str, env: dict | None = None) -> list[dict]:
    """Train the tiny recipe as run ``name`` under ``tmp_path`` (extra ``env`` for the run); its
    metrics, one record per step."""
    cmd = [sys.executable, "-m", "launch.cli", "train", str(TINY), f"run.name={name}",
           f"run.output_dir={tmp_path}", "logging.progress=false", "logging.tensorboard=false", *overrides]  # fmt: skip
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})}
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def own_ray_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment (and ``env``) for a run that starts a Ray cluster of its own, the
    README's path, instead of joining the tier's shared one (tests/e2e/conftest.py)."""
    return {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "RAY_ADDRESS"}
