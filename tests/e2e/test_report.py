"""`moe-rl report` on a real run directory: the 4-step tiny-MoE run of `moe-rl train` the tier
shares (`async_run`: asynchronous, top-p 0.9, the mismatch probe every step), then the report's PNGs
exist, are real images, and report.md names the run's recipe and tables the mismatch budget the probe
logged."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import image

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PNGS = ("reward.png", "mismatch.png", "masked.png", "routing.png", "timings.png", "budget.png")
SHARES = ("routing", "truncation", "precision", "staleness")


def test_report_of_a_tiny_run(async_run):
    run = async_run
    _check_budget_metrics([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
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
    assert "rollout.quant=fp8_block128" in md and "routing_replay=r3" in md and "4 steps" in md
    assert all(f"]({name})" in md for name in PNGS)
    assert "| `old/kl_k3` |" in md and "| `old/routing_agreement` |" in md
    assert "## Mismatch budget" in md and "| truncation (KSM removes) | 4 of 4 |" in md
    assert "| staleness (async adds) | 3 of 4 |" in md


def _check_budget_metrics(records: list[dict]) -> None:
    """Every step probed: the shares are finite; top-p 0.9 leaves a truncation share KSM removes,
    fp8 weights a precision share; staleness applies once batches are a version or more old."""
    assert [r["policy/staleness"] > 0 for r in records] == [False, True, True, True]
    for r in records:
        values = [r[f"mismatch/{share}"] for share in SHARES]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), r
        assert r["mismatch/truncation"] > 0 and r["mismatch/precision"] > 0
        assert "mismatch/routing_na" not in r and "mismatch/truncation_na" not in r
        same = r["mismatch/routing"] + r["mismatch/truncation"] + r["mismatch/precision"]
        assert math.isclose(same, r["probe/kl_k3_plain"], rel_tol=1e-5, abs_tol=1e-12)
    assert (
        records[0]["mismatch/staleness"] == 0.0
        and "policy/staleness=0" in records[0]["mismatch/staleness_na"]
    )
    for r in records[1:]:
        assert "mismatch/staleness_na" not in r
        assert math.isclose(
            r["mismatch/staleness"], r["old/kl_k3"] - r["probe/kl_k3"], rel_tol=1e-9, abs_tol=1e-15
        )
