"""The terminal view of `moe-rl diagnose`: two rich tables (mismatch; corrections and routing),
one row per recipe and mode, the mismatch budget per recipe, then the verdicts. A metric that is
not available shows as ``n/a`` with its reason listed under the table (in the JSON it is the full
``"not available: ..."``). `write_budget_png` draws the budget as one stacked bar per recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moe_rl.diagnostics.budget import SAME_WEIGHTS, SHARE_TITLES, SHARES, MismatchBudget, stack_bars
from moe_rl.diagnostics.results import (
    MODE_TITLES,
    MODES,
    DiagnoseReport,
    NotAvailable,
    RecipeResult,
    is_number,
)
from moe_rl.diagnostics.verdicts import SURVEY

MISMATCH_COLUMNS = (
    ("kl_k1", "KL k1"),
    ("kl_k3", "KL k3"),
    ("chi2_token", "χ² tok"),
    ("chi2_seq", "χ² seq"),
    ("ess_token", "ESS tok"),
    ("ess_seq", "ESS seq"),
    ("ppl_ratio", "PPL ratio"),
    ("prob_pearson", "Pearson p"),
    ("prob_abs_diff_max", "max |Δp|"),
    ("prob_abs_diff_mean", "mean |Δp|"),
)
SHARE_COLUMNS = (
    ("icepop_masked_frac", "IcePop tok"),
    ("mis_masked_seq_frac", "MIS seq"),
    ("mis_masked_token_frac", "MIS tok"),
    ("opsm_masked_seq_frac", "OPSM seq"),
    ("outside_top_p_frac", "outside top-p"),
    ("routing_agreement", "routing used"),
    ("routing_agreement_natural", "routing natural"),
)
PERCENT = {
    "icepop_masked_frac",
    "mis_masked_seq_frac",
    "mis_masked_token_frac",
    "opsm_masked_seq_frac",
    "outside_top_p_frac",
}
PIPE_WIDTH = 200
"""Console width when stdout is not a terminal (a file or a pipe): the tables fit unwrapped."""
LEVEL_STYLE = {"ok": "green", "note": "cyan", "warn": "yellow", "act": "bold red"}


def format_value(key: str, value, reasons: list[str]) -> str:
    """A cell: percent for shares, 4 decimals for agreements and ratios near 1, else 3 digits."""
    if isinstance(value, NotAvailable):
        if value.reason not in reasons:
            reasons.append(value.reason)
        return f"n/a[{reasons.index(value.reason) + 1}]"
    if not is_number(value):
        return "?"
    if key in PERCENT:
        return f"{value:.2%}"
    if key.startswith(("routing", "ess", "prob_pearson", "ppl")):
        return f"{value:.4f}"
    return "0" if value == 0 else f"{value:.3g}"


def _table(report: DiagnoseReport, title: str, columns, reasons: list[str]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("recipe")
    table.add_column("trainer mode")
    for _, header in columns:
        table.add_column(header, justify="right")
    for result in report.results:
        if result.unavailable is not None:
            cell = format_value("", result.unavailable, reasons)
            table.add_row(result.quant, "all", cell, *([""] * (len(columns) - 1)))
            table.add_section()
            continue
        for mode in MODES:
            mark = " *" if mode == result.configured_mode else ""
            cells = [format_value(key, result.value(mode, key), reasons) for key, _ in columns]
            table.add_row(result.quant if mode == MODES[0] else "", MODE_TITLES[mode] + mark, *cells)
        table.add_section()
    return table


def budget_cell(budget: MismatchBudget, share: str, reasons: list[str]) -> str:
    """A share in KL k3 and as a percentage of the same-weights KL (signed), or ``n/a[i]``."""
    value = getattr(budget, share)
    if isinstance(value, NotAvailable):
        return format_value(share, value, reasons)
    total = budget.same_weights
    percent = f" ({value / total:+.1%})" if total > 0 else ""
    return ("0" if value == 0 else f"{value:.3g}") + percent


def budget_table(report: DiagnoseReport, reasons: list[str]) -> Table:
    """One row per recipe: KL k3 without corrections and its split by source (`budget`)."""
    table = Table(
        title="Mismatch budget: KL k3 at the same weights by source",
        title_justify="left",
        header_style="bold",
    )
    table.add_column("recipe")
    table.add_column("KL k3, no R3/KSM", justify="right")
    for share in SHARES:
        table.add_column(SHARE_TITLES[share], justify="right")
    for result in report.results:
        if result.unavailable is not None:
            table.add_row(result.quant, format_value("", result.unavailable, reasons), *([""] * len(SHARES)))
            continue
        budget = result.budget
        if budget is None:
            continue
        cells = [budget_cell(budget, share, reasons) for share in SHARES]
        table.add_row(result.quant, format_value("kl_k3", budget.same_weights, reasons), *cells)
    return table


def _verdict_lines(result: RecipeResult) -> list[str]:
    if result.unavailable is not None:
        return [f"[bold]{result.quant}[/]: {escape(str(result.unavailable))}"]
    lines = [f"[bold]{result.quant}[/] (trains as {MODE_TITLES[result.configured_mode]}):"]
    for v in result.verdicts:
        style = LEVEL_STYLE[v.level]
        lines.append(f"  [{style}]{v.level:>4}[/] {escape(v.message)}  [dim]({escape(v.source)})[/]")
    return lines


def render(report: DiagnoseReport, console: Console | None = None) -> None:
    """Print the tables, the reasons behind every ``n/a``, and the verdicts."""
    console = console or Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)
    reasons: list[str] = []
    head = (
        f"zero-update test of {report.recipe}: rollout.engine={report.engine}, "
        f"{report.num_prompts} prompts x {report.responses_per_prompt} responses, seed {report.seed}; "
        "engine (rollout_logp) vs trainer "
        "(old_logp) at the same weights"
    )
    console.print(head)
    console.print(_table(report, "Mismatch (docs/algorithms.md, 'Diagnostics')", MISMATCH_COLUMNS, reasons))
    console.print(
        _table(report, "Masked shares at the recipe's bands; routing agreement", SHARE_COLUMNS, reasons)
    )
    console.print(
        "* the mode the recipe trains with. 'routing used': the routing the trainer computed with vs the "
        "engine's; 'routing natural': the trainer routers' own choice vs the engine's."
    )
    if any(result.budget is not None for result in report.results):
        console.print(budget_table(report, reasons))
        console.print(
            "routing + truncation + precision = the KL without R3 and KSM (percentages of it, signed); "
            "with both R3 and KSM measured, routing and truncation are each the mean KL drop over the "
            "two orders of removal."
        )
    for i, reason in enumerate(reasons, 1):
        console.print(f"n/a[{i}]: not available: {reason}", markup=False)
    console.print(f"verdicts ('survey': {SURVEY}):", markup=False)
    for result in report.results:
        for line in _verdict_lines(result):
            console.print(line)
    console.print(f"[dim]{report.seconds:.1f} s[/]")


def write_json(report: DiagnoseReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return path


def write_budget_png(report: DiagnoseReport, path: str | Path) -> Path:
    """The same-weights budget as a stacked bar per recipe (matplotlib, Agg backend); shares that
    do not apply are named under their recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, budgets = [], []
    for result in report.results:
        budget = result.budget
        if result.unavailable is not None or budget is None:
            labels.append(f"{result.quant}\nnot available")
            budgets.append({})
            continue
        missing = [s for s in SAME_WEIGHTS if isinstance(getattr(budget, s), NotAvailable)]
        labels.append(result.quant + "".join(f"\n{s}: n/a" for s in missing))
        budgets.append({s: budget.amount(s) for s in SAME_WEIGHTS})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(max(6.0, 2.2 * len(labels) + 2), 4.8), dpi=110, layout="constrained")
    ax = fig.subplots()
    stack_bars(ax, labels, budgets, SAME_WEIGHTS)
    name = Path(report.recipe).stem if report.recipe else "the recipe"
    ax.set_title(f"Mismatch budget of {name} (rollout.engine={report.engine}, same weights)")
    fig.savefig(path)
    plt.close(fig)
    return path
