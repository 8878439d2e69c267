"""The mismatch budget: the engine–trainer KL split by where it comes from.

All terms are KL k3 (``mean_t(rho − log rho − 1)``, ``log rho = old_logp − rollout_logp`` over
the sampled tokens; `moe_rl.algo.diagnostics.mismatch_metrics`). `measure` gives it at the same
weights in four trainer modes, ``K(plain)``, ``K(r3)``, ``K(ksm)``, ``K(r3+ksm)``; then

* ``routing``: what R3 removes (R3, arXiv 2510.11370). With both R3 and keep-sampling-mask
  measured it is the mean of the drop R3 gives without and with KSM,
  ``((K(plain) − K(r3)) + (K(ksm) − K(r3+ksm))) / 2``; with KSM not applicable ``K(plain) − K(r3)``;
* ``truncation``: what keep-sampling-mask removes (DeepSeek-V3.2 §3.1: the trainer normalizes over
  the engine's kept top-k/top-p set), ``((K(plain) − K(ksm)) + (K(r3) − K(r3+ksm))) / 2``, or
  ``K(plain) − K(ksm)`` with R3 not applicable;
* ``precision``: what remains with every applicable removal on, ``K(r3+ksm)`` (or ``K(r3)``,
  ``K(ksm)``, ``K(plain)``): quantization and kernel numerics at identical weights;
* ``staleness`` (asynchronous training only): what older rollout weights add,
  ``old/kl_k3 − probe/kl_k3`` of the step the probe runs at (`staleness_metrics`).

Averaging the two orders (the Shapley value of a two-source split) makes routing and truncation
independent of the order they are removed in; ``routing + truncation + precision = K(plain)``
exactly. ``interaction = (K(plain) − K(r3)) − (K(ksm) − K(r3+ksm))`` is how far the two
sequential orders differ (each gives one source ± interaction/2). Shares are signed: a removal
that raises the KL (noise, or a source that partly cancels another) is negative.

A share that does not apply — the engine returns no routed experts, the sampling truncates nothing
(``top_p = 1``, ``top_k = -1``), a synchronous step — is `NotAvailable` with the reason, counted
as 0; a source that is present but cannot be removed (top-p sampling on an engine without
sampling masks) then stays inside ``precision``, and its reason says so.

Pure Python (no torch), like `results` and `verdicts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_rl.config.derived import sampling_truncates
from moe_rl.diagnostics.values import NotAvailable, Value, is_number

SHARES = ("routing", "truncation", "precision", "staleness")
"""Sources of the mismatch, in the order they are stacked."""
SAME_WEIGHTS = SHARES[:3]
"""The shares a measurement at equal weights gives (`moe-rl diagnose`, the probe)."""
SHARE_TITLES = {
    "routing": "routing (R3 removes)",
    "truncation": "truncation (KSM removes)",
    "precision": "precision (remains)",
    "staleness": "staleness (async adds)",
}
SHARE_COLORS = {
    "routing": "tab:blue",
    "truncation": "tab:orange",
    "precision": "tab:gray",
    "staleness": "tab:red",
}
METRIC_PREFIX = "mismatch/"
"""Metrics: ``mismatch/<share>`` (a float, 0 when the share does not apply) and, for a share that
does not apply, ``mismatch/<share>_na`` with the reason."""
KEPT_IN_PRECISION = "not removed, so counted in precision"
ZERO_UPDATE = NotAvailable("zero-update test: engine and trainer hold the same weights")
SYNC_STEP = NotAvailable("the batch was generated with the weights it trained (policy/staleness=0)")


@dataclass(frozen=True)
class MismatchBudget:
    """KL k3 per source (see the module docstring); `NotAvailable` for a share that does not apply."""

    routing: Value
    truncation: Value
    precision: float
    staleness: Value = field(default=ZERO_UPDATE)
    interaction: Value = field(default=NotAvailable("needs both R3 and keep-sampling-mask"))

    def amount(self, share: str) -> float:
        """The share as a number: 0 when it does not apply."""
        value = getattr(self, share)
        return float(value) if is_number(value) else 0.0

    @property
    def same_weights(self) -> float:
        """``routing + truncation + precision``: K(plain), the KL with no correction at equal weights."""
        return sum(self.amount(s) for s in SHARES if s != "staleness")

    @property
    def total(self) -> float:
        return self.same_weights + self.amount("staleness")

    def to_json(self) -> dict[str, Any]:
        """Shares as numbers, or ``"not available: <reason>"``; plus the sums."""
        out: dict[str, Any] = {}
        for key in (*SHARES, "interaction"):
            value = getattr(self, key)
            out[key] = value if is_number(value) else str(value)
        out.update(same_weights=self.same_weights, total=self.total)
        return out

    def metrics(self, shares: tuple[str, ...] = SHARES) -> dict[str, float | str]:
        """``mismatch/<share>`` for ``shares``, plus ``mismatch/<share>_na`` (the reason) where one
        does not apply."""
        out: dict[str, float | str] = {}
        for share in shares:
            value = getattr(self, share)
            out[METRIC_PREFIX + share] = self.amount(share)
            if isinstance(value, NotAvailable):
                out[f"{METRIC_PREFIX}{share}_na"] = value.reason
        return out


def truncation_applies(top_k: int, top_p: float) -> NotAvailable | None:
    """None when the sampling truncates the vocabulary, else why keep-sampling-mask removes nothing."""
    if sampling_truncates(top_k, top_p):
        return None
    return NotAvailable(f"rollout.top_p={top_p:g} and rollout.top_k={top_k}: sampling truncates nothing")


def _not_removed(mode_kl: Value | None) -> NotAvailable:
    """A removal that could not be measured (its mode's `NotAvailable`, or no such mode)."""
    reason = mode_kl.reason if isinstance(mode_kl, NotAvailable) else "not measured"
    return NotAvailable(f"{reason}; {KEPT_IN_PRECISION}")


def mismatch_budget(kl_k3: Mapping[str, Value], truncation: NotAvailable | None) -> MismatchBudget:
    """The same-weights budget from KL k3 per trainer mode (``plain``, ``ksm``, ``r3``,
    ``r3+ksm``; a `NotAvailable` for a mode the batch cannot support). ``truncation``: None when
    the sampling truncates (`truncation_applies`), else why it does not."""
    plain = kl_k3.get("plain")
    if not is_number(plain):
        raise ValueError(f"the mismatch budget needs KL k3 without corrections (mode 'plain'), got {plain!r}")
    r3, ksm, both = kl_k3.get("r3"), kl_k3.get("ksm"), kl_k3.get("r3+ksm")
    has_r3, has_ksm = is_number(r3), truncation is None and is_number(ksm)
    if has_r3 and has_ksm and is_number(both):
        return MismatchBudget(
            routing=((plain - r3) + (ksm - both)) / 2,
            truncation=((plain - ksm) + (r3 - both)) / 2,
            precision=float(both),
            interaction=(plain - r3) - (ksm - both),
        )
    no_routing = _not_removed(r3)
    no_truncation = truncation or _not_removed(ksm)
    if has_r3:
        return MismatchBudget(plain - r3, no_truncation, float(r3))
    if has_ksm:
        return MismatchBudget(no_routing, plain - ksm, float(ksm))
    return MismatchBudget(no_routing, no_truncation, float(plain))


def kl_by_mode(modes: Mapping[str, Mapping[str, Value]]) -> dict[str, Value]:
    """``{mode: kl_k3}`` of `measure`'s results."""
    return {
        mode: metrics.get("kl_k3", NotAvailable("kl_k3 was not measured")) for mode, metrics in modes.items()
    }


def staleness_metrics(record: Mapping[str, Any]) -> dict[str, float | str]:
    """``mismatch/staleness`` of a training step that ran the probe: ``old/kl_k3`` (the batch's
    engine log-probs against the trainer's at the newer weights it trains with, in the recipe's
    mode) minus ``probe/kl_k3`` (engine against trainer at equal weights, same mode). Assumes the
    same-weights KL is the same on the probe's prompts and weights as on the batch's."""
    behind, stale, same = record.get("policy/staleness"), record.get("old/kl_k3"), record.get("probe/kl_k3")
    value: Value
    if not is_number(behind) or behind <= 0:
        value = SYNC_STEP
    elif not is_number(stale) or not is_number(same):
        missing = " and ".join(
            k for k, v in (("old/kl_k3", stale), ("probe/kl_k3", same)) if not is_number(v)
        )
        value = NotAvailable(f"no {missing} in the step's metrics")
    else:
        value = float(stale) - float(same)
    out: dict[str, float | str] = {METRIC_PREFIX + "staleness": float(value) if is_number(value) else 0.0}
    if isinstance(value, NotAvailable):
        out[METRIC_PREFIX + "staleness_na"] = value.reason
    return out


def stack_bars(
    ax, labels: list[str], budgets: list[Mapping[str, float]], shares: tuple[str, ...] = SHARES
) -> None:
    """Draw one stacked bar per label on matplotlib axes ``ax``: positive shares stack up from 0,
    negative ones down from 0; a black tick marks the net total, written above the bar.
    ``budgets``: ``{share: KL}`` per label (empty: nothing measured, no bar)."""
    x = list(range(len(labels)))
    up, down = [0.0] * len(labels), [0.0] * len(labels)
    for share in shares:
        values = [b.get(share, 0.0) for b in budgets]
        bottoms = [u if v >= 0 else d for v, u, d in zip(values, up, down)]
        ax.bar(x, values, bottom=bottoms, color=SHARE_COLORS[share], label=SHARE_TITLES[share], width=0.6)
        up = [u + max(v, 0.0) for u, v in zip(up, values)]
        down = [d + min(v, 0.0) for d, v in zip(down, values)]
    net = [sum(b.get(s, 0.0) for s in shares) for b in budgets]
    ax.scatter(x, net, marker="_", s=400, color="black", zorder=3, label="net KL k3")
    for i, (top, total) in enumerate(zip(up, net)):
        if not budgets[i]:  # nothing measured (a recipe that cannot run)
            continue
        ax.annotate(
            f"{total:.3g}", (i, top), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, labels)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylabel("KL k3 (nats per token)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
