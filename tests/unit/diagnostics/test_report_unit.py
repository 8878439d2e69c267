"""`moe-rl report` on a synthetic run directory: plots drawn from what is there, a plot with
nothing to show replaced by its reason in report.md, verdicts from the metrics."""

from __future__ import annotations

import json

import pytest
from matplotlib import image

from moe_rl.diagnostics.report import PLOTS, series, summary_table, write_report


def write_run(folder, steps=5, routing=True):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for i in range(steps):
            record = {
                "step": i, "reward/mean": 0.1 * i, "reward/std": 0.05, "reward/max": 0.5,
                "old/kl_k1": 1e-3, "old/kl_k3": 2e-4, "old/chi2_token": 1.5, "old/chi2_seq": 3.0,
                "old/ess_token": 0.4, "old/ess_seq": 0.3, "train/icepop_masked_frac": 0.002,
                "train/clip_frac": 0.05, "time/rollout_s": 1.0, "time/reward_s": 0.1,
                "time/old_logp_s": 0.3, "time/train_s": 0.5, "time/sync_s": 0.1, "time/step_s": 2.2,
                "quant/recipe": "bf16",
            }  # fmt: skip
            if routing:
                record["old/routing_agreement"] = 0.97
            if i % 2:  # the mismatch probe ran
                record |= {"mismatch/routing": 1e-4, "mismatch/truncation": 2e-5, "mismatch/precision": 5e-5,
                           "mismatch/staleness": 0.0, "mismatch/staleness_na": "policy/staleness=0"}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    return folder


def test_plots_and_markdown(tmp_path):
    run = write_run(tmp_path / "run")
    written = write_report(run)
    assert [p.name for p in written] == [*(p.name for p in PLOTS), "report.md"]
    for path in written[:-1]:
        height, width = image.imread(path).shape[:2]
        assert path.stat().st_size > 10_000 and width >= 800 and height >= 400, path
    md = (run / "report" / "report.md").read_text()
    assert md.endswith("\n") and not md.endswith("\n\n")  # one final newline
    assert "![Reward](reward.png)" in md and "| `old/kl_k3` | 0.0002 |" in md
    assert "IS variance blow-up" in md  # χ² token 1.5 > 1 → Cause D
    assert "no config.yaml" in md
    assert "| routing (R3 removes) | 2 of 2 | 0.0001 | 0.0001 | +58.8% |" in md
    assert "| staleness (async adds) | 0 of 2 | n/a: policy/staleness=0 | | |" in md


def test_missing_routing_is_explained_not_plotted(tmp_path):
    run = write_run(tmp_path / "run", routing=False)
    out = tmp_path / "elsewhere"
    names = [p.name for p in write_report(run, out)]
    assert "routing.png" not in names and not (out / "routing.png").exists()
    assert (
        "Routing agreement: not available: no routing agreement in metrics.jsonl"
        in (out / "report.md").read_text()
    )


def test_series_skips_non_numbers_and_summary_has_stats():
    records = [{"step": 0, "a": 1.0}, {"step": 1, "a": "nan"}, {"step": 2, "a": 3.0}]
    assert series(records, "a") == ([0, 2], [1.0, 3.0])
    rows = summary_table([{"step": 0, "reward/mean": 1.0}, {"step": 1, "reward/mean": 3.0}])
    assert rows[-1] == "| `reward/mean` | 1 | 3 | 2 | 1 | 3 |"


def test_empty_metrics_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no step records"):
        write_report(tmp_path)
