"""Runs of `moe-rl train` on the tiny recipe for e2e tests: the real CLI in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe.yaml"
LEARN_STEPS = 20
"""Steps of the learning run (`learned_run`, tests/e2e/conftest.py): the tiny recipe's reward goes
from about 0.06 (steps 0-4) to 0.4-0.54 (steps 15-19) on each seed measured
(docs/advantage_estimators.md)."""


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


def check_parallel_steps(records: list[dict], adapters_only: bool) -> None:
    """Three RL steps of a two-rank expert- or pipeline-parallel group with R3 and keep-sampling-mask:
    each owner sent its own weights (``adapters_only``: a LoRA run's adapters, synced apart), the
    same bytes every sync, and the engine's routing reached every rank."""
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:  # each sync: what trains (the adapters, the output layer), the same bytes
        assert r["sync/adapters_only"] == int(adapters_only) and r["sync/bytes"] == records[0]["sync/bytes"]
        assert r["train/update_ok"] == 1.0 and r["train/grad_norm"] > 0
        # R3 replays the engine's routing; the routers' own choice agrees to fp8 precision in the
        # old-logp pass and drifts as the weights move
        assert 0.9 < r["old/routing_agreement"] <= 1.0 and 0 < r["train/routing_agreement"] <= 1.0
        assert r["old/kl_k3"] < 1e-3  # fp8 engine vs the trainer with keep-sampling-mask
        assert r["sync/senders"] == 2  # each expert-parallel rank / pipeline stage sends its own
