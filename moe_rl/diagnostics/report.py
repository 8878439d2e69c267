"""`moe-rl report RUN_DIR`: PNG plots and `report.md` from a run's `metrics.jsonl`.

Writes into ``RUN_DIR/report/``: ``reward.png``, ``mismatch.png`` (KL, χ², ESS of π_old vs the
engine), ``masked.png`` (shares masked by IcePop / OPSM / rejection, clipped by PPO and TIS),
``routing.png`` (routing agreement), ``timings.png`` (stage timings as stacked shares of the
step) and ``budget.png`` (the mismatch budget of each probed step as a stacked bar,
`moe_rl.diagnostics.budget`), plus ``report.md``: a summary table, the mismatch budget, the plots,
and the decision-tree verdicts (`verdicts.run_verdicts`). A plot with no metric to show is not
drawn; the summary says why. Matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.diagnostics import verdicts
from moe_rl.diagnostics.budget import METRIC_PREFIX, SHARE_TITLES, SHARES, stack_bars
from moe_rl.diagnostics.values import NotAvailable, is_number
from moe_rl.run_dir import read_metrics

log = logging.getLogger(__name__)

Records = Sequence[Mapping[str, Any]]

MISMATCH_SERIES = {
    "kl": (("old/kl_k1", "KL k1 (rollout − old)"), ("old/kl_k3", "KL k3")),
    "chi2": (("old/chi2_token", "χ² token"), ("old/chi2_seq", "χ² sequence")),
    "ess": (("old/ess_token", "ESS token"), ("old/ess_seq", "ESS sequence")),
}
SHARE_SERIES = (
    ("train/icepop_masked_frac", "IcePop masked tokens"),
    ("train/opsm_masked_seq_frac", "OPSM masked sequences"),
    ("train/opsm_masked_token_frac", "OPSM masked tokens"),
    ("train/rejection_masked_seq_frac", "MIS rejected sequences"),
    ("train/tis_clip_frac", "TIS clipped tokens"),
    ("train/clip_frac", "PPO-clipped tokens"),
)
ROUTING_SERIES = (
    ("old/routing_agreement", "π_old pass: engine vs trainer routers"),
    ("old/routing_overlap", "π_old pass: expert overlap (share of top-k)"),
    ("train/routing_agreement", "update passes: engine vs trainer routers"),
)
STAGES = (
    ("time/rollout_s", "rollout"),
    ("time/reward_s", "reward"),
    ("time/old_logp_s", "old log-probs"),
    ("time/train_s", "train"),
    ("time/sync_s", "weight sync"),
)
SUMMARY_KEYS = (
    "reward/mean", "response/length_mean", "old/kl_k1", "old/kl_k3", "old/chi2_token", "old/chi2_seq",
    "old/ess_token", "old/ess_seq", "old/prob_pearson", "old/routing_agreement",
    "train/icepop_masked_frac", "train/opsm_masked_seq_frac", "train/clip_frac", "train/grad_norm",
    "time/step_s",
)  # fmt: skip


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the records that have it as a number."""
    pairs = [(int(r["step"]), float(r[key])) for r in records if is_number(r.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


@dataclass
class Plot:
    """One PNG: its file name, title, and the function that draws it on a new figure."""

    name: str
    title: str
    keys: tuple[str, ...]
    draw: Callable[[Any, Records], None]


def _lines(ax, records: Records, specs, scale: float = 1.0) -> int:
    drawn = 0
    for key, label in specs:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, [v * scale for v in values], marker="o", markersize=3, label=label)
            drawn += 1
    return drawn


def _finish(ax, xlabel: str, ylabel: str, title: str | None = None, outside: bool = False) -> None:
    """Labels, grid, whole-number steps and the legend (``outside``: right of the axes, so it hides
    no band)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # RL steps: no 0.5
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if outside:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.legend(fontsize=8)


def draw_reward(fig, records: Records) -> None:
    ax = fig.subplots()
    steps, mean = series(records, "reward/mean")
    ax.plot(steps, mean, marker="o", markersize=3, label="mean")
    std = dict(zip(*series(records, "reward/std")))
    if std:
        low = [m - std.get(s, 0) for s, m in zip(steps, mean)]
        high = [m + std.get(s, 0) for s, m in zip(steps, mean)]
        ax.fill_between(steps, low, high, alpha=0.2, label="± std")
    _lines(ax, records, (("reward/max", "max"),))
    _finish(ax, "RL step", "reward per response (task score)")


def draw_mismatch(fig, records: Records) -> None:
    axes = fig.subplots(1, 3)
    for ax, (kind, specs) in zip(axes, MISMATCH_SERIES.items()):
        _lines(ax, records, specs)
        if kind == "kl":
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.axhline(verdicts.KL_K3_NEGLIGIBLE, color="gray", ls=":", lw=1, label="k3 negligible (1e-4)")
            # k1 and k2 are per-token estimators of the KL: their batch mean can fall below 0
            _finish(ax, "RL step", "nats per token (estimates: k1 can be < 0)", "KL(engine ‖ trainer π_old)")
        elif kind == "chi2":
            ax.set_yscale("symlog", linthresh=1e-4)
            ax.axhline(verdicts.CHI2_MODERATE, color="orange", ls=":", lw=1, label="moderate (0.3)")
            ax.axhline(verdicts.CHI2_HIGH, color="red", ls=":", lw=1, label="blow-up (1.0)")
            _finish(ax, "RL step", "E[ρ²] − 1 (a sample estimate: can be < 0)", "χ² divergence")
        else:
            ax.axhline(verdicts.ESS_LOW, color="red", ls=":", lw=1, label="low (0.5)")
            ax.set_ylim(0, 1.05)
            _finish(ax, "RL step", "ESS / samples (1.0: engine and trainer agree)", "effective sample size")


def draw_masked(fig, records: Records) -> None:
    ax = fig.subplots()
    _lines(ax, records, SHARE_SERIES, scale=100.0)
    ax.axhline(100 * verdicts.ICEPOP_LIMIT, color="red", ls=":", lw=1, label="IcePop limit (10 %)")
    _finish(ax, "RL step", "share masked or clipped (%)")


def draw_routing(fig, records: Records) -> None:
    ax = fig.subplots()
    _lines(ax, records, ROUTING_SERIES)
    ax.axhline(verdicts.ROUTING_AGREEMENT_MIN, color="red", ls=":", lw=1, label="enable-R3 line (0.9)")
    _finish(ax, "RL step", "share of (token, MoE layer) with equal top-k sets")


def draw_timings(fig, records: Records) -> None:
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    rows = [r for r in records if is_number(r.get("time/step_s")) and r["time/step_s"] > 0]
    steps = [int(r["step"]) for r in rows]
    shares = [[100 * float(r.get(key, 0) or 0) / r["time/step_s"] for r in rows] for key, _ in STAGES]
    other = [max(0.0, 100 - sum(col)) for col in zip(*shares)]
    left.stackplot(steps, *shares, other, labels=[label for _, label in STAGES] + ["other"], alpha=0.85)
    left.set_ylim(0, 100)
    _finish(left, "RL step", "share of step wall time (%)", "stage shares", outside=True)
    right.bar(steps, [r["time/step_s"] for r in rows], color="gray")
    _finish(right, "RL step", "step wall time (s)", "step time")


def budget_records(records: Records) -> Records:
    """The steps the mismatch probe ran at (they carry ``mismatch/precision``)."""
    return [r for r in records if is_number(r.get(METRIC_PREFIX + "precision"))]


def draw_budget(fig, records: Records) -> None:
    probed = budget_records(records)
    ax = fig.subplots()
    budgets = [{s: _number(r.get(METRIC_PREFIX + s)) for s in SHARES} for r in probed]
    stack_bars(ax, [str(r["step"]) for r in probed], budgets)
    ax.set_xlabel("RL step (mismatch probe)")
    missing = [s for s in SHARES if all(METRIC_PREFIX + s + "_na" in r for r in probed)]
    if missing:
        ax.set_title("n/a: " + ", ".join(missing), fontsize=9)


PLOTS = (
    Plot("reward.png", "Reward", ("reward/mean",), draw_reward),
    Plot(
        "mismatch.png",
        "Training–inference mismatch (engine vs trainer π_old)",
        tuple(k for specs in MISMATCH_SERIES.values() for k, _ in specs),
        draw_mismatch,
    ),
    Plot("masked.png", "Masked and clipped shares", tuple(k for k, _ in SHARE_SERIES), draw_masked),
    Plot("routing.png", "Routing agreement", tuple(k for k, _ in ROUTING_SERIES), draw_routing),
    Plot("timings.png", "Stage timings", ("time/step_s",), draw_timings),
    Plot(
        "budget.png",
        "Mismatch budget: engine vs trainer KL k3 by source",
        (METRIC_PREFIX + "precision",),
        draw_budget,
    ),
)


def missing_reason(plot: Plot, records: Records) -> NotAvailable | None:
    """Why ``plot`` cannot be drawn (None: it can)."""
    if any(series(records, key)[0] for key in plot.keys):
        return None
    if plot.name == "routing.png":
        return NotAvailable(
            "no routing agreement in metrics.jsonl (engine without routed experts, or R3/R2 off)"
        )
    if plot.name == "budget.png":
        return NotAvailable("the mismatch probe did not run (logging.diagnose_every=0)")
    return NotAvailable(f"none of {', '.join(plot.keys)} in metrics.jsonl")


def save_plot(plot: Plot, records: Records, folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide = plot.name in ("mismatch.png", "timings.png")
    fig = plt.figure(figsize=(15 if wide else 8, 4.5), dpi=110, layout="constrained")
    plot.draw(fig, records)
    fig.suptitle(plot.title)
    path = folder / plot.name
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.4g}"


def summary_table(records: Records) -> list[str]:
    """Markdown rows: first, last, mean, min and max of the headline metrics present."""
    lines = ["| metric | first | last | mean | min | max |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key in SUMMARY_KEYS:
        _, values = series(records, key)
        if values:
            stats = (values[0], values[-1], sum(values) / len(values), min(values), max(values))
            lines.append(f"| `{key}` | " + " | ".join(_fmt(v) for v in stats) + " |")
    return lines


def recipe_setup(run_dir: Path) -> tuple[verdicts.Setup | None, str]:
    """The run's stability setup and a one-line description, from its `config.yaml`."""
    from moe_rl.config import ConfigError, load_recipe

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None, "no config.yaml in the run directory"
    try:
        config = load_recipe(path)
    except ConfigError as exc:
        log.warning("%s: %s; verdicts assume no corrections are on", path, exc)
        return None, f"config.yaml not loadable ({exc})"
    from moe_rl.diagnostics.binding import setup_of

    c = config.algo.corrections
    line = (
        f"run `{config.run.name}`: rollout.engine={config.rollout.engine}, "
        f"rollout.quant={config.rollout.quant}, "
        f"algo.objective={config.algo.objective}, routing_replay={config.algo.routing_replay}, "
        f"KSM={c.keep_sampling_mask}, IcePop={c.icepop.enabled}, OPSM={c.opsm.enabled}, "
        f"MIS={c.rejection.enabled}, TIS={c.tis.mode}"
    )
    return setup_of(config), line


def _number(value: Any) -> float:
    return float(value) if is_number(value) else 0.0


def _applied(probed: Records, key: str) -> list[float]:
    """Values of ``key`` at the probed steps where its share applied (no ``<key>_na`` reason)."""
    return [float(r[key]) for r in probed if key + "_na" not in r and is_number(r.get(key))]


def budget_table(records: Records) -> list[str]:
    """Markdown rows of the mismatch budget over the probed steps: per share the mean and last
    value where it applied, its signed percentage of the mean total, or why it did not apply."""
    probed = budget_records(records)
    if not probed:
        return ["Not measured: the mismatch probe did not run (`logging.diagnose_every=0`)."]
    applied = {share: _applied(probed, METRIC_PREFIX + share) for share in SHARES}
    means = {share: sum(v) / len(v) for share, v in applied.items() if v}
    total = sum(means.values())
    lines = [
        "| source | probes | mean KL k3 | last | share of total |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for share, values in applied.items():
        count = f"{len(values)} of {len(probed)}"
        if not values:
            na = METRIC_PREFIX + share + "_na"
            reasons = "; ".join(dict.fromkeys(str(r.get(na, "not logged")) for r in probed))
            lines.append(f"| {SHARE_TITLES[share]} | {count} | n/a: {reasons} | | |")
            continue
        percent = f"{means[share] / total:+.1%}" if total > 0 else ""
        lines.append(
            f"| {SHARE_TITLES[share]} | {count} | {_fmt(means[share])} | {_fmt(values[-1])} | {percent} |"
        )
    lines.append(f"| total | | {_fmt(total)} | | |")
    return lines


def markdown(run_dir: Path, records: Records, drawn: Mapping[str, Path | NotAvailable]) -> str:
    setup, line = recipe_setup(run_dir)
    steps = [int(r["step"]) for r in records]
    intro = f"Run directory `{run_dir}`; {len(records)} steps ({min(steps)}–{max(steps)}). {line}."
    out = [f"# Run report: {run_dir.name}", "", intro, "", "## Summary", "", *summary_table(records), ""]
    out += [
        "## Mismatch budget", "",
        "KL k3 of the engine's log-probs against the trainer's, split by source: routing (what R3 "
        "removes) + truncation (what keep-sampling-mask removes) + precision (what remains at equal "
        "weights), measured by the mismatch probe; staleness: what older rollout weights add "
        "(`old/kl_k3` − `probe/kl_k3`, asynchronous steps).", "",
        *budget_table(records), "",
    ]  # fmt: skip
    out += [
        "## Verdicts", "",
        f"Decision tree of the survey ({verdicts.SURVEY}) on the mean `old/` metrics (engine vs "
        "trainer π_old at the rollout weights) and the trends:", "",
    ]  # fmt: skip
    found = verdicts.run_verdicts(records, setup)
    out += [f"- **{v.level}** {v.message} _({v.source})_" for v in found] or ["- no rule fired"]
    out += ["", "## Plots", ""]
    for plot in PLOTS:
        where = drawn[plot.name]
        out.append(f"![{plot.title}]({plot.name})" if isinstance(where, Path) else f"- {plot.title}: {where}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"  # one final newline


def write_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the plots and `report.md` into ``out_dir`` (default ``run_dir/report``)."""
    records = [r for r in read_metrics(run_dir) if is_number(r.get("step"))]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step records")
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, Path | NotAvailable] = {}
    for plot in PLOTS:
        reason = missing_reason(plot, records)
        drawn[plot.name] = reason if reason is not None else save_plot(plot, records, out_dir)
    md = out_dir / "report.md"
    md.write_text(markdown(run_dir, records, drawn))
    return [p for p in drawn.values() if isinstance(p, Path)] + [md]
