"""`moe-rl report` on a real run directory: a 3-step tiny-MoE run of `moe-rl train`, then the
report's PNGs exist, are real images, and report.md names the run's recipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import image

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PNGS = ("reward.png", "mismatch.png", "masked.png", "routing.png", "timings.png")


def test_report_of_a_tiny_run(tmp_path):
    train = [sys.executable, "-m", "launch.cli", "train", str(REPO / "recipes" / "tiny_moe.yaml"),
             "run.steps=3", f"run.output_dir={tmp_path}", "logging.tensorboard=false"]  # fmt: skip
    subprocess.run(train, check=True, cwd=REPO, capture_output=True, timeout=600)
    run = tmp_path / "tiny_moe"
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "report", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for name in PNGS:
        path = run / "report" / name
        height, width, _ = image.imread(path).shape
        assert path.stat().st_size > 20_000 and width >= 800 and height >= 400, (name, width, height)
    md = (run / "report" / "report.md").read_text()
    assert "rollout.quant=fp8_block128" in md and "routing_replay=r3" in md and "3 steps" in md
    assert all(f"]({name})" in md for name in PNGS)
    assert "| `old/kl_k3` |" in md and "| `old/routing_agreement` |" in md
