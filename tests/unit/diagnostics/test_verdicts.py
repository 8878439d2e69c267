"""The decision-tree rules on hand-made metrics: each fires on its side of its threshold, abstains
on "not available", and recommends only what the recipe does not already do."""

from __future__ import annotations

import pytest

from moe_rl.diagnostics import verdicts as v
from moe_rl.diagnostics.results import NotAvailable

CLEAN = {
    "kl_k1": 1e-6, "kl_k3": 1e-7, "chi2_token": 1e-5, "chi2_seq": 1e-4, "ess_token": 1.0, "ess_seq": 1.0,
    "ppl_ratio": 1.0, "prob_pearson": 0.9999, "icepop_masked_frac": 0.0, "outside_top_p_frac": 0.0,
    "routing_agreement": 0.99,
}  # fmt: skip


def codes(found):
    return [x.code for x in found]


def with_(**changes):
    return {**CLEAN, **changes}


def test_negligible_below_1e_4_and_not_above():
    assert v.rule_negligible(CLEAN, v.Setup()).level == "ok"
    assert v.rule_negligible(with_(kl_k3=2e-4), v.Setup()) is None


def test_no_drift_needs_pearson_kl_and_ppl():
    m = with_(kl_k3=1e-3, kl_k1=0.01)
    assert v.rule_no_drift(m, v.Setup()).code == "no_drift"
    assert v.rule_no_drift({**m, "prob_pearson": 0.98}, v.Setup()) is None
    assert v.rule_no_drift({**m, "kl_k1": 0.03}, v.Setup()) is None


@pytest.mark.parametrize(
    "change, needle",
    [({"prob_pearson": 0.94}, "Pearson 0.940 < 0.95"), ({"kl_k1": 0.06}, "KL k1 0.06 > 0.05"),
     ({"ppl_ratio": 1.08}, "PPL ratio 1.080 far from 1")],
)  # fmt: skip
def test_cause_a_fires_on_each_symptom(change, needle):
    found = v.rule_engine_mismatch(with_(**change), v.Setup())
    assert found.code == "cause_a_precision" and found.level == "act" and needle in found.message
    assert v.rule_engine_mismatch(CLEAN, v.Setup()) is None


def test_cause_d_recommends_icepop_unless_on_and_escalates_below_ess_0_3():
    off = v.rule_variance_blowup(with_(chi2_token=1.5), v.Setup())
    assert "enable IcePop" in off.message and "χ² token 1.5 > 1.0" in off.message
    on = v.rule_variance_blowup(with_(chi2_token=1.5), v.Setup(icepop=True))
    assert "keep IcePop on" in on.message
    low = v.rule_variance_blowup(with_(ess_token=0.2), v.Setup())
    assert "systems fix" in low.message
    assert v.rule_variance_blowup(with_(chi2_token=0.99, ess_token=0.51), v.Setup()) is None


def test_cause_c_between_0_3_and_1_with_healthy_ess():
    assert v.rule_moderate_drift(with_(chi2_token=0.5), v.Setup()).code == "cause_c_token_drift"
    assert "rejection is on" in v.rule_moderate_drift(with_(chi2_token=0.5), v.Setup(rejection=True)).message
    assert v.rule_moderate_drift(with_(chi2_token=0.29), v.Setup()) is None
    assert v.rule_moderate_drift(with_(chi2_token=0.5, ess_token=0.4), v.Setup()) is None  # that is D


def test_sequence_drift_and_icepop_limit():
    assert v.rule_sequence_drift(with_(chi2_seq=3.0), v.Setup()).code == "sequence_drift"
    assert v.rule_sequence_drift(with_(chi2_seq=3.0, chi2_token=0.5), v.Setup()) is None
    assert v.rule_icepop_limit(with_(icepop_masked_frac=0.11), v.Setup()).code == "icepop_limit"
    assert v.rule_icepop_limit(with_(icepop_masked_frac=0.09), v.Setup()) is None


def test_routing_rule_enables_r3_only_when_off_and_reports_what_r3_buys():
    plain, r3 = with_(routing_agreement=0.85, kl_k3=2e-3), with_(routing_agreement=1.0, kl_k3=1e-3)
    act = v.rule_routing(plain, r3, v.Setup(routing_replay="off"))
    assert act.code == "enable_r3" and "0.850 < 0.9" in act.message
    assert "with R3: agreement 1.000, KL k3 0.001 (without: 0.002)" in act.message
    on = v.rule_routing(plain, r3, v.Setup(routing_replay="r3"))
    assert on.code == "routing" and on.level == "ok"
    assert v.rule_routing(with_(routing_agreement=0.95), {}, v.Setup()).level == "ok"


def test_routing_rule_with_no_routing_says_why_and_acts_if_r3_was_asked():
    missing = NotAvailable("rollout.engine=vllm on cpu returns no routed experts")
    note = v.rule_routing(with_(routing_agreement=missing), {}, v.Setup(routing_replay="r2"))
    assert note.level == "note" and "not available: rollout.engine=vllm" in note.message
    assert v.rule_routing(with_(routing_agreement=missing), {}, v.Setup(routing_replay="r3")).level == "act"


def test_sampling_mask_rule():
    outside = with_(outside_top_p_frac=0.01)
    assert v.rule_sampling_mask(outside, CLEAN, v.Setup()).code == "enable_ksm"
    assert v.rule_sampling_mask(outside, CLEAN, v.Setup(keep_sampling_mask=True)) is None
    truncated = with_(kl_k3=4e-3)  # full-vocabulary normalizer vs the engine's kept-set one
    found = v.rule_sampling_mask(truncated, with_(kl_k3=1e-6), v.Setup())
    assert "over the kept sets" in found.message and "enable algo.corrections" in found.message
    no_masks = v.rule_sampling_mask(outside, {"kl_k3": NotAvailable("no masks")}, v.Setup())
    assert "KSM is not available: no masks" in no_masks.message
    assert v.rule_sampling_mask(CLEAN, CLEAN, v.Setup()) is None


def test_not_available_values_make_rules_abstain():
    missing = dict.fromkeys(CLEAN, NotAvailable("x"))
    for rule in v.MISMATCH_RULES:
        assert rule(missing, v.Setup()) is None


def test_zero_update_verdicts_compare_r3_within_the_configured_ksm_choice():
    modes = {
        "plain": with_(kl_k3=5e-3, routing_agreement=0.8),
        "ksm": with_(kl_k3=3e-3, routing_agreement=0.8),
        "r3": with_(kl_k3=4e-3, routing_agreement=1.0),
        "r3+ksm": with_(kl_k3=1e-3, routing_agreement=1.0),
    }
    found = v.zero_update_verdicts(modes, "ksm", v.Setup(keep_sampling_mask=True))
    routing = next(x for x in found if x.code == "enable_r3")
    assert "KL k3 0.001 (without: 0.003)" in routing.message


def test_run_verdicts_on_records_clip_and_length_trends():
    records = [
        {"step": i, "old/kl_k3": 1e-6, "old/kl_k1": 1e-5, "train/clip_frac": 0.1 + 0.05 * i,
         "response/length_mean": 100 + 20 * i, "quant/recipe": "fp8"}
        for i in range(4)
    ]  # fmt: skip
    found = codes(v.run_verdicts(records, None))
    assert found == ["negligible", "cause_e_clip", "cause_f_length"]
    flat = [{**r, "train/clip_frac": 0.1, "response/length_mean": 10} for r in records]
    assert codes(v.run_verdicts(flat, None)) == ["negligible"]
    short = [{**r, "response/length_mean": length} for r, length in zip(flat, (6.1, 6.5, 7.0, 7.4))]
    assert codes(v.run_verdicts(short, None)) == ["negligible"]  # +21 % of 6 tokens: noise, not a surge


def test_run_verdicts_routing_only_when_r3_is_off():
    records = [{"step": 0, "old/routing_agreement": 0.8}]
    assert "enable_r3" in codes(v.run_verdicts(records, v.Setup(routing_replay="off")))
    assert "enable_r3" not in codes(v.run_verdicts(records, v.Setup(routing_replay="r3")))


def test_verdict_level_is_checked():
    with pytest.raises(ValueError, match=r"Verdict.level='bad'"):
        v.Verdict("bad", "x", "y", "z")


def test_verdicts_results_binding_and_budget_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, moe_rl.diagnostics.verdicts, moe_rl.diagnostics.results, moe_rl.diagnostics.binding, "
        "moe_rl.diagnostics.budget; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
