"""The mismatch budget: the split of KL k3 by source against hand-computed values, "not available"
with the reason (and 0 in the sums) where a share does not apply, its metrics, the staleness
share of a training step, and the stacked bars in `moe-rl diagnose` and `moe-rl report`."""

from __future__ import annotations

import json

import matplotlib
import pytest
from hypothesis import given
from hypothesis import strategies as st
from matplotlib import image
from matplotlib.figure import Figure
from rich.console import Console

from moe_rl.diagnostics.budget import (
    SHARES,
    MismatchBudget,
    kl_by_mode,
    mismatch_budget,
    stack_bars,
    staleness_metrics,
    truncation_applies,
)
from moe_rl.diagnostics.render import render, write_budget_png, write_json
from moe_rl.diagnostics.report import budget_table, write_report
from moe_rl.diagnostics.results import DiagnoseReport, NotAvailable, RecipeResult

matplotlib.use("Agg")

NO_ROUTING = NotAvailable("rollout.engine=vllm on cpu returns no routed experts")
NO_MASKS = NotAvailable("rollout.engine=vllm on cpu returns no sampling masks")
FULL = {"plain": 10e-4, "r3": 4e-4, "ksm": 7e-4, "r3+ksm": 2e-4}


def test_both_removals_average_the_two_orders():
    """R3 first: routing 6, truncation 2; KSM first: truncation 3, routing 5 (units of 1e-4)."""
    b = mismatch_budget(FULL, truncation=None)
    assert b.routing == pytest.approx(5.5e-4) and b.truncation == pytest.approx(2.5e-4)
    assert b.precision == 2e-4 and b.interaction == pytest.approx(1e-4)
    assert b.same_weights == pytest.approx(FULL["plain"])
    assert isinstance(b.staleness, NotAvailable) and b.total == b.same_weights


def test_without_routing_the_routing_mismatch_stays_in_precision():
    b = mismatch_budget({**FULL, "r3": NO_ROUTING, "r3+ksm": NO_ROUTING}, truncation=None)
    assert isinstance(b.routing, NotAvailable) and b.amount("routing") == 0.0
    assert b.routing.reason == f"{NO_ROUTING.reason}; not removed, so counted in precision"
    assert b.truncation == pytest.approx(3e-4) and b.precision == 7e-4
    assert isinstance(b.interaction, NotAvailable)


def test_top_p_1_truncates_nothing_and_engine_without_masks_keeps_it_in_precision():
    assert truncation_applies(top_k=-1, top_p=0.9) is None and truncation_applies(top_k=20, top_p=1.0) is None
    none = truncation_applies(top_k=-1, top_p=1.0)
    assert none == NotAvailable("rollout.top_p=1 and rollout.top_k=-1: sampling truncates nothing")
    b = mismatch_budget(FULL, truncation=none)  # KSM measured, but removes nothing to count
    assert b.truncation == none and b.routing == pytest.approx(6e-4) and b.precision == 4e-4
    vllm = mismatch_budget({"plain": 3e-4, "ksm": NO_MASKS, "r3": NO_ROUTING, "r3+ksm": NO_ROUTING}, None)
    assert vllm.truncation.reason.startswith(NO_MASKS.reason) and vllm.precision == 3e-4
    assert vllm.amount("routing") == vllm.amount("truncation") == 0.0


def test_shares_are_signed():
    """Replaying the routing raises the KL here: the routing share is negative, the sum holds."""
    b = mismatch_budget({"plain": 1e-4, "r3": 3e-4}, truncation=NotAvailable("top_p=1"))
    assert b.routing == pytest.approx(-2e-4) and b.precision == 3e-4
    assert b.same_weights == pytest.approx(1e-4)


def test_no_uncorrected_kl_is_an_error():
    with pytest.raises(ValueError, match="mode 'plain'"):
        mismatch_budget({"plain": NO_ROUTING}, None)
    assert kl_by_mode({"plain": {"kl_k3": 1.0}, "ksm": {}}) == {
        "plain": 1.0,
        "ksm": NotAvailable("kl_k3 was not measured"),
    }


kl = st.floats(0.0, 1.0, allow_nan=False)


@given(kl, kl, kl, kl, st.booleans(), st.booleans(), st.booleans())
def test_the_same_weights_shares_always_sum_to_the_uncorrected_kl(
    plain, r3, ksm, both, has_r3, has_ksm, trunc
):
    modes = {"plain": plain, "r3": r3 if has_r3 else NO_ROUTING, "ksm": ksm if has_ksm else NO_MASKS}
    modes["r3+ksm"] = both if has_r3 and has_ksm else NO_ROUTING
    b = mismatch_budget(modes, None if trunc else NotAvailable("top_p=1"))
    assert b.same_weights == pytest.approx(plain, abs=1e-12)
    assert isinstance(b.routing, NotAvailable) == (not has_r3)
    assert isinstance(b.truncation, NotAvailable) == (not (has_ksm and trunc))


def test_metrics_carry_zero_and_the_reason_for_a_share_that_does_not_apply():
    b = mismatch_budget({"plain": 3e-4, "ksm": 1e-4, "r3": NO_ROUTING, "r3+ksm": NO_ROUTING}, None)
    out = b.metrics(shares=("routing", "truncation", "precision"))
    assert out["mismatch/routing"] == 0.0 and "no routed experts" in out["mismatch/routing_na"]
    assert out["mismatch/truncation"] == pytest.approx(2e-4) and "mismatch/truncation_na" not in out
    assert out["mismatch/precision"] == 1e-4 and "mismatch/staleness" not in out
    assert b.to_json()["routing"].startswith("not available: ")


def test_staleness_of_a_step():
    stale = {"policy/staleness": 1, "old/kl_k3": 5e-4, "probe/kl_k3": 2e-4}
    assert staleness_metrics(stale) == {"mismatch/staleness": pytest.approx(3e-4)}
    sync = staleness_metrics({**stale, "policy/staleness": 0})
    assert sync["mismatch/staleness"] == 0.0 and "policy/staleness=0" in sync["mismatch/staleness_na"]
    blind = staleness_metrics({"policy/staleness": 1, "probe/kl_k3": 2e-4})
    assert blind["mismatch/staleness_na"] == "no old/kl_k3 in the step's metrics"


def test_stacked_bars_stack_negative_shares_below_zero():
    ax = Figure().subplots()
    stack_bars(ax, ["a", "b"], [{"routing": 2.0, "precision": 1.0}, {"routing": -1.0, "precision": 3.0}])
    drawn = {(round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in ax.patches}
    assert {d for d in drawn if d[2] != 0} == {(0, 0.0, 2.0), (0, 2.0, 1.0), (1, 0.0, -1.0), (1, 0.0, 3.0)}


def diagnose_report() -> DiagnoseReport:
    fp8 = RecipeResult("fp8_block128", engine="megatron", device="cpu", configured_mode="r3+ksm")
    fp8.budget = mismatch_budget(FULL, truncation=None)
    vllm = RecipeResult("bf16", engine="vllm", device="cpu")
    vllm.budget = mismatch_budget({"plain": 1e-6, "ksm": NO_MASKS, "r3": NO_ROUTING}, truncation=None)
    nvfp4 = RecipeResult("nvfp4", engine="megatron", unavailable=NotAvailable("nvfp4 needs CUDA"))
    return DiagnoseReport("recipes/tiny_moe.yaml", "megatron", 4, 2, 1, [fp8, vllm, nvfp4], seconds=1.0)


def test_diagnose_prints_writes_and_draws_the_budget(tmp_path):
    report = diagnose_report()
    console = Console(record=True, width=300)
    render(report, console)
    text = console.export_text()
    assert "Mismatch budget" in text
    (fp8_row,) = [line for line in text.splitlines() if "fp8_block128" in line and "0.00055" in line]
    assert "0.00055 (+55.0%)" in fp8_row and "0.00025 (+25.0%)" in fp8_row and "0.0002 (+20.0%)" in fp8_row
    (vllm_row,) = [line for line in text.splitlines() if line.startswith("│ bf16") and "1e-06" in line]
    assert vllm_row.count("n/a[") == 3  # routing, truncation (engine) and staleness (zero update)
    assert "counted in precision" in text and "zero-update test" in text
    data = json.loads(write_json(report, tmp_path / "d.json").read_text())
    assert data["recipes"][0]["budget"]["routing"] == pytest.approx(5.5e-4)
    assert data["recipes"][1]["budget"]["routing"].startswith("not available: rollout.engine=vllm")
    assert "budget" not in data["recipes"][2]
    png = write_budget_png(report, tmp_path / "budget.png")
    height, width = image.imread(png).shape[:2]
    assert png.stat().st_size > 10_000 and width >= 600 and height >= 400


def test_report_tables_the_budget_of_the_probed_steps():
    records = [
        {"step": 0, "policy/staleness": 0},
        {"step": 1, "mismatch/routing": 2e-4, "mismatch/truncation": 1e-4, "mismatch/precision": 1e-4,
         "mismatch/staleness": 0.0, "mismatch/staleness_na": "the batch was generated with the weights"},
        {"step": 3, "mismatch/routing": 4e-4, "mismatch/truncation": 1e-4, "mismatch/precision": 1e-4,
         "mismatch/staleness": 2e-4},
    ]  # fmt: skip
    rows = budget_table(records)
    assert "| routing (R3 removes) | 2 of 2 | 0.0003 | 0.0004 | +42.9% |" in rows
    assert "| staleness (async adds) | 1 of 2 | 0.0002 | 0.0002 | +28.6% |" in rows
    assert rows[-1] == "| total | | 0.0007 | | |"
    sync = [{**r, "mismatch/staleness_na": "sync"} for r in records[1:]]
    assert "| staleness (async adds) | 0 of 2 | n/a: sync | | |" in budget_table(sync)
    assert budget_table(records[:1]) == [
        "Not measured: the mismatch probe did not run (`logging.diagnose_every=0`)."
    ]


def test_report_draws_budget_png(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": i, "reward/mean": 0.1, "mismatch/routing": 1e-4 * i, "mismatch/precision": 1e-5,
              "mismatch/truncation": 0.0, "mismatch/truncation_na": "top_p=1", "mismatch/staleness": 0.0,
              "mismatch/staleness_na": "sync"} for i in range(3)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    written = {p.name for p in write_report(run)}
    assert "budget.png" in written
    md = (run / "report" / "report.md").read_text()
    assert "## Mismatch budget" in md and "| truncation (KSM removes) | 0 of 3 | n/a: top_p=1 | | |" in md
    assert set(SHARES) == {"routing", "truncation", "precision", "staleness"}
    assert MismatchBudget(1.0, 0.0, 1.0).amount("routing") == 1.0
