"""Verdicts: the survey's decision tree as rules over measured mismatch.

Source (the "survey" of the rules and their messages): Chris Yuhao Liu, "Off-Policy Drift in LLM
RL" (blog post, 2026), https://chrisliu298.ai/posts/off-policy-drift-in-llm-rl/, sections
"Diagnosing and fixing off-policy drift: a decision tree" (Step 1 classifies the symptom, Step 2
names cause A–F and the smallest fix) and "When to escalate from RS → IS → systems fix". Its thresholds are "operational defaults, not laws"; the
ones the survey does not give are marked *ours*. Each rule is one short function that returns a
`Verdict` or None; `zero_update_verdicts` runs them on one quantization recipe of `moe-rl
diagnose`, `run_verdicts` on the per-step metrics of a training run (`moe-rl report`).

Pure Python (no torch): metrics are plain dicts of floats, where a missing or non-numeric value
(a `NotAvailable`) makes a rule abstain rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_rl.config.modes import ReplayMode
from moe_rl.diagnostics.results import is_number

SURVEY = (
    'Chris Yuhao Liu, "Off-Policy Drift in LLM RL" (blog post, 2026), '
    "https://chrisliu298.ai/posts/off-policy-drift-in-llm-rl/"
)
"""The source of the decision tree: a verdict whose source says "survey" means this post."""

KL_K3_NEGLIGIBLE = 1e-4
"""*Ours*: below this the mismatch is at the floor of the measurement. CompassMax-V3
(arXiv 2512.07710) reports router replay taking the train/infer log-prob gap from ~1e-3 to ~1e-4."""
KL_K1_NO_DRIFT = 0.02
"""Survey Step 1: ``kl < 0.02`` with Pearson ≥ 0.99 and PPL ratio ≈ 1 is no meaningful drift."""
KL_K1_ENGINE_BUG = 0.05
"""Survey Step 1 / Cause A: ``kl > 0.05`` on the same checkpoint is an engine mismatch."""
PEARSON_OK, PEARSON_BAD = 0.99, 0.95
"""Survey "Debug probability metrics" (verl): on-policy ≥ 0.99; below 0.95 something is off."""
PPL_RATIO_FAR = 0.05
"""*Ours*: |PPL ratio − 1| above this is "far from 1.0" (the survey gives no number)."""
CHI2_MODERATE, CHI2_HIGH = 0.3, 1.0
"""Survey Causes C and D: ``chi2_token > 0.3`` moderate drift; ``> 1.0`` IS variance blow-up
(the IS variance then exceeds twice the on-policy level)."""
CHI2_SEQ_HIGH = 1.0
"""*Ours*, for the survey's SGA protocol case "TV low but χ² high" at sequence level."""
ESS_LOW, ESS_SYSTEMS = 0.5, 0.3
"""Survey Cause D (``ess < 0.5``) and escalation to a systems fix (ESS below 0.3)."""
ICEPOP_LIMIT = 0.10
"""Survey Cause D: an IcePop mask rate above 10–25 % means correction has hit its limit."""
ROUTING_AGREEMENT_MIN = 0.9
"""*Ours*: below this share of matching top-k sets, routing flips dominate (R3, arXiv 2510.11370)."""
OUTSIDE_TOP_P_MAX = 1e-3
"""*Ours*: share of sampled tokens outside the trainer's own top-p/top-k set that calls for KSM."""
CLIP_FRAC_HIGH = 0.2
"""Survey Cause E: ``pg_clipfrac > 0.2`` and rising."""
LENGTH_SURGE, LENGTH_WINDOW = 1.2, 100
"""Survey Cause F: response length up more than 20 % within 100 steps."""
LENGTH_SURGE_MIN_TOKENS = 16
"""*Ours*: a surge of fewer tokens than this is noise on a short task (7.4 vs 6.1 is 21 %)."""

LEVELS = ("ok", "note", "warn", "act")


@dataclass(frozen=True)
class Verdict:
    """One finding: how urgent (`LEVELS`), what to do, and where the rule comes from."""

    level: str
    code: str
    message: str
    source: str

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"Verdict.level={self.level!r}; valid: {', '.join(LEVELS)}")

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "code": self.code, "message": self.message, "source": self.source}


@dataclass(frozen=True)
class Setup:
    """What the recipe already does (rules recommend only what is not on)."""

    routing_replay: str = "off"
    keep_sampling_mask: bool = False
    icepop: bool = False
    rejection: bool = False


def _num(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if is_number(value) else None


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# ------------------------------------------------------------------ mismatch rules (Step 1, A, C, D)
def rule_negligible(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """KL k3 < 1e-4 (*ours*): nothing to correct; keep metrics-only mode (survey rec. 1)."""
    kl = _num(m, "kl_k3")
    if kl is None or kl >= KL_K3_NEGLIGIBLE:
        return None
    return Verdict(
        "ok", "negligible", f"KL k3 = {_fmt(kl)} < {KL_K3_NEGLIGIBLE:g}: mismatch negligible",
        "survey, practical recommendation 1 (metrics-only baseline); threshold ours",
    )  # fmt: skip


def rule_no_drift(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Pearson ≥ 0.99, PPL ratio ≈ 1, KL k1 < 0.02: no meaningful drift (survey Step 1)."""
    kl, r, ppl = _num(m, "kl_k1"), _num(m, "prob_pearson"), _num(m, "ppl_ratio")
    k3 = _num(m, "kl_k3")
    if None in (kl, r, ppl) or (k3 is not None and k3 < KL_K3_NEGLIGIBLE):
        return None
    if abs(kl) < KL_K1_NO_DRIFT and r >= PEARSON_OK and abs(ppl - 1) <= PPL_RATIO_FAR:
        return Verdict(
            "ok", "no_drift",
            f"Pearson {r:.4f} >= {PEARSON_OK}, KL k1 {_fmt(kl)} < {KL_K1_NO_DRIFT}: no meaningful drift",
            "survey decision tree, Step 1",
        )  # fmt: skip
    return None


def rule_engine_mismatch(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Cause A: Pearson < 0.95, KL k1 > 0.05 or PPL ratio far from 1 at the same weights."""
    kl, r, ppl = _num(m, "kl_k1"), _num(m, "prob_pearson"), _num(m, "ppl_ratio")
    why = []
    if r is not None and r < PEARSON_BAD:
        why.append(f"Pearson {r:.3f} < {PEARSON_BAD}")
    if kl is not None and kl > KL_K1_ENGINE_BUG:
        why.append(f"KL k1 {_fmt(kl)} > {KL_K1_ENGINE_BUG}")
    if ppl is not None and abs(ppl - 1) > PPL_RATIO_FAR:
        why.append(f"PPL ratio {ppl:.3f} far from 1")
    if not why:
        return None
    return Verdict(
        "act", "cause_a_precision",
        "; ".join(why) + ": precision/kernel/engine mismatch at the same weights; fix precision "
        "(a finer quantization recipe, aligned dtypes/kernels) before correcting algorithmically",
        "survey decision tree, Cause A",
    )  # fmt: skip


def rule_variance_blowup(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Cause D: χ² token > 1 or ESS < 0.5 → IcePop band masking, or fix precision."""
    chi2, ess = _num(m, "chi2_token"), _num(m, "ess_token")
    why = []
    if chi2 is not None and chi2 > CHI2_HIGH:
        why.append(f"χ² token {_fmt(chi2)} > {CHI2_HIGH}")
    if ess is not None and ess < ESS_LOW:
        why.append(f"ESS {ess:.3f} < {ESS_LOW}")
    if not why:
        return None
    fix = (
        "keep IcePop on and fix precision"
        if setup.icepop
        else "enable IcePop (algo.corrections.icepop) or fix precision"
    )
    if ess is not None and ess < ESS_SYSTEMS:
        fix = f"ESS below {ESS_SYSTEMS}: a systems fix (precision, routing) is needed, not more correction"
    return Verdict(
        "act", "cause_d_variance", "; ".join(why) + f": IS variance blow-up; {fix}",
        "survey decision tree, Cause D, and 'When to escalate'",
    )  # fmt: skip


def rule_moderate_drift(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Cause C: 0.3 < χ² token ≤ 1 with ESS ≥ 0.5 → geometric-mean rejection (MIS)."""
    chi2, ess = _num(m, "chi2_token"), _num(m, "ess_token")
    if chi2 is None or not CHI2_MODERATE < chi2 <= CHI2_HIGH or (ess is not None and ess < ESS_LOW):
        return None
    fix = (
        "rejection is on: watch its masked share"
        if setup.rejection
        else ("enable geometric-mean rejection (algo.corrections.rejection, k1 seq_mean)")
    )
    return Verdict(
        "warn", "cause_c_token_drift",
        f"χ² token {_fmt(chi2)} > {CHI2_MODERATE}: moderate token drift; {fix}",
        "survey decision tree, Cause C",
    )  # fmt: skip


def rule_sequence_drift(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """χ² token low but χ² seq high: sequence-level masking, not sequence TIS (SGA protocol)."""
    chi2, seq = _num(m, "chi2_token"), _num(m, "chi2_seq")
    if chi2 is None or seq is None or chi2 > CHI2_MODERATE or seq <= CHI2_SEQ_HIGH:
        return None
    return Verdict(
        "warn", "sequence_drift",
        f"χ² seq {_fmt(seq)} > {CHI2_SEQ_HIGH} with χ² token {_fmt(chi2)}: drift accumulates over "
        "long responses; prefer geometric-mean rejection or OPSM over sequence TIS",
        "survey, SGA framework diagnostic protocol; threshold ours",
    )  # fmt: skip


def rule_icepop_limit(m: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """IcePop masking more than 10 % of tokens: correction at its limit (Cause D)."""
    share = _num(m, "icepop_masked_frac")
    if share is None or share <= ICEPOP_LIMIT:
        return None
    return Verdict(
        "act", "icepop_limit",
        f"IcePop band masks {share:.1%} of tokens > {ICEPOP_LIMIT:.0%}: algorithmic correction at its "
        "limit; fix the precision or routing gap",
        "survey decision tree, Cause D (10–25 % mask rate)",
    )  # fmt: skip


MISMATCH_RULES: tuple[Callable[[Mapping[str, Any], Setup], Verdict | None], ...] = (
    rule_negligible,
    rule_no_drift,
    rule_engine_mismatch,
    rule_variance_blowup,
    rule_moderate_drift,
    rule_sequence_drift,
    rule_icepop_limit,
)


# ------------------------------------------------------------------ routing and sampling-mask rules
def rule_routing(plain: Mapping[str, Any], r3: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Routing agreement < 0.9 with R3 off → enable R3 [R3, arXiv 2510.11370; DeepSeek-V3.2
    Keep Routing]; with R3 measured, report what it buys."""
    agree = plain.get("routing_agreement")
    if not is_number(agree):
        if setup.routing_replay == ReplayMode.R3:
            return Verdict(
                "act", "r3_unavailable", f"R3 is on but routing is {agree}", "R3, arXiv 2510.11370"
            )
        return Verdict("note", "routing_unknown", f"routing agreement {agree}", "R3, arXiv 2510.11370")
    kl_plain, kl_r3 = _num(plain, "kl_k3"), _num(r3, "kl_k3")
    with_r3 = ""
    if kl_plain is not None and kl_r3 is not None:
        agree_r3 = _num(r3, "routing_agreement")
        shown = "n/a" if agree_r3 is None else f"{agree_r3:.3f}"
        with_r3 = f"; with R3: agreement {shown}, KL k3 {_fmt(kl_r3)} (without: {_fmt(kl_plain)})"
    if agree < ROUTING_AGREEMENT_MIN and setup.routing_replay != ReplayMode.R3:
        return Verdict(
            "act", "enable_r3",
            f"routing agreement {agree:.3f} < {ROUTING_AGREEMENT_MIN} and R3 off: enable R3 "
            f"(algo.routing_replay=r3){with_r3}",
            "R3, arXiv 2510.11370; survey 'MoE routing'; threshold ours",
        )  # fmt: skip
    level = "ok" if agree >= ROUTING_AGREEMENT_MIN or setup.routing_replay == ReplayMode.R3 else "warn"
    message = f"routing agreement {agree:.3f} (algo.routing_replay={setup.routing_replay}){with_r3}"
    return Verdict(level, "routing", message, "R3, arXiv 2510.11370")


def rule_sampling_mask(plain: Mapping[str, Any], ksm: Mapping[str, Any], setup: Setup) -> Verdict | None:
    """Keep-sampling-mask [DeepSeek-V3.2 §3.1] when KSM is off and either sampled tokens fall
    outside the trainer's own top-p/top-k set, or normalizing over the engine's kept set (what
    its processed log-probs are) takes KL k3 below half of the full-vocabulary value."""
    if setup.keep_sampling_mask:
        return None
    share, kl_plain, kl_ksm = _num(plain, "outside_top_p_frac"), _num(plain, "kl_k3"), _num(ksm, "kl_k3")
    why = []
    if share is not None and share > OUTSIDE_TOP_P_MAX:
        why.append(f"{share:.2%} of sampled tokens lie outside the trainer's own top-p/top-k set")
    if kl_plain is not None and kl_ksm is not None and kl_plain >= KL_K3_NEGLIGIBLE and kl_ksm < kl_plain / 2:
        why.append(f"KL k3 {_fmt(kl_plain)} over the full vocabulary vs {_fmt(kl_ksm)} over the kept sets")
    if not why:
        return None
    if kl_ksm is None:
        fix = f"KSM is {ksm.get('kl_k3')}; use an engine with sampling masks or top_p=1, top_k=-1"
    else:
        fix = "enable algo.corrections.keep_sampling_mask"
    return Verdict(
        "act", "enable_ksm", "; ".join(why) + f": {fix}",
        "DeepSeek-V3.2 §3.1 (Keep Sampling Mask); thresholds ours",
    )  # fmt: skip


def zero_update_verdicts(
    modes: Mapping[str, Mapping[str, Any]], configured: str, setup: Setup
) -> list[Verdict]:
    """Verdicts for one recipe of the zero-update test: mismatch rules on the configured mode,
    the routing rule on no-replay vs R3 (with the configured KSM choice), the sampling-mask rule
    on no-KSM vs KSM (without replay)."""
    main = modes.get(configured, {})
    found = [rule(main, setup) for rule in MISMATCH_RULES]
    ksm = "ksm" if configured.endswith("ksm") else ""
    found.append(
        rule_routing(modes.get(ksm or "plain", {}), modes.get("r3+" + ksm if ksm else "r3", {}), setup)
    )
    found.append(rule_sampling_mask(modes.get("plain", {}), modes.get("ksm", {}), setup))
    return [v for v in found if v is not None]


# ------------------------------------------------------------------ run rules (Causes E, F)
def rule_clip_saturation(records: Sequence[Mapping[str, Any]]) -> Verdict | None:
    """Cause E: PPO clip fraction > 0.2 and rising → reduce update pressure (fewer epochs, lower
    LR) or a length-invariant objective (GSPO)."""
    clip = [r["train/clip_frac"] for r in records if is_number(r.get("train/clip_frac"))]
    if len(clip) < 2 or clip[-1] <= CLIP_FRAC_HIGH or clip[-1] <= clip[0]:
        return None
    return Verdict(
        "act", "cause_e_clip",
        f"clip fraction {clip[-1]:.2f} > {CLIP_FRAC_HIGH} and rising (from {clip[0]:.2f}): reduce "
        "update pressure (LR, mini-batches) before widening the clip",
        "survey decision tree, Cause E",
    )  # fmt: skip


def rule_length_surge(records: Sequence[Mapping[str, Any]]) -> Verdict | None:
    """Cause F: mean response length up > 20 % within 100 steps → halve the LR (Zhang et al. 2026)."""
    series = [
        (r["step"], r["response/length_mean"]) for r in records if is_number(r.get("response/length_mean"))
    ]
    for i, (step, length) in enumerate(series):
        earlier = [v for s, v in series[:i] if step - s <= LENGTH_WINDOW and v > 0]
        if (
            earlier
            and length / min(earlier) > LENGTH_SURGE
            and length - min(earlier) >= LENGTH_SURGE_MIN_TOKENS
        ):
            return Verdict(
                "warn", "cause_f_length",
                f"response length {length:.1f} at step {step} is > {LENGTH_SURGE - 1:.0%} above "
                f"{min(earlier):.1f} within {LENGTH_WINDOW} steps: decay the LR; audit the reward",
                "survey decision tree, Cause F",
            )  # fmt: skip
    return None


def run_verdicts(records: Sequence[Mapping[str, Any]], setup: Setup | None) -> list[Verdict]:
    """Verdicts for a training run: mismatch rules on the mean of the ``old/`` metrics over the
    steps (π_old vs the engine at the rollout weights), plus Causes E and F on the trends."""
    setup = setup or Setup()
    means = mean_metrics(records, "old/")
    means["icepop_masked_frac"] = mean_metrics(records, "train/").get("icepop_masked_frac")
    found = [rule(means, setup) for rule in MISMATCH_RULES]
    agree = means.get("routing_agreement")
    if is_number(agree) and agree < ROUTING_AGREEMENT_MIN and setup.routing_replay != ReplayMode.R3:
        found.append(rule_routing({"routing_agreement": agree}, {}, setup))
    found += [rule_clip_saturation(records), rule_length_surge(records)]
    return [v for v in found if v is not None]


def mean_metrics(records: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """Mean over the records of every numeric ``prefix``-key, with the prefix dropped."""
    sums: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(prefix) and is_number(value):
                sums.setdefault(key[len(prefix) :], []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items()}
