"""moe_rl.algo.registry: the recipe's typed modes and values → bound functions; every keyword a
function gets is declared and checked against its signature when the recipe is resolved."""

import dataclasses
import functools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.algo import corrections, objectives, registry
from moe_rl.algo.modes import (
    Advantage,
    Aggregation,
    Divergence,
    KLEstimator,
    Objective,
    PolicyMode,
    RejectionAggregation,
    TISMode,
)
from moe_rl.algo.objectives import LossOutput
from moe_rl.config.schema import AlgoConfig, CorrectionsConfig
from tests.unit.algo.algo_testing import seq_ids_for, t

REPO = Path(__file__).resolve().parents[3]
ALGO = dataclasses.asdict(AlgoConfig())  # the schema's values: the one home of the defaults


def params(objective: Objective, **overrides) -> dict:
    """The hyper-parameters `objective` binds, at the schema's values."""
    return {**{k: ALGO[k] for k in registry.OBJECTIVE_PARAMS[objective]}, **overrides}


def sections(**overrides) -> dict:
    """The recipe's correction sections (the schema's values, all off), with `overrides` merged in."""
    out = dataclasses.asdict(CorrectionsConfig())
    del out["keep_sampling_mask"]
    for section, fields in overrides.items():
        out[section] = {**out[section], **fields}
    return out


def test_registry_imports_without_torch():
    code = "import sys; import moe_rl.algo.registry as r; assert 'torch' not in sys.modules; print(r.OBJECTIVE_CALL)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "logp" in out.stdout


def batch():
    torch.manual_seed(0)
    n, seq = 7, seq_ids_for([3, 4])
    return {
        "logp": (-torch.rand(n, dtype=torch.float64)).requires_grad_(),
        "old_logp": -torch.rand(n, dtype=torch.float64),
        "advantages": torch.tensor([1.0] * 3 + [-1.0] * 4, dtype=torch.float64),
        "entropy": torch.rand(n, dtype=torch.float64),
        "loss_mask": torch.ones(n, dtype=torch.bool),
        "seq_ids": seq,
        "num_seqs": 2,
        "weights": None,
        "vocab_size": 100,
        "rewards": t([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]),
    }


@pytest.mark.parametrize("objective", list(Objective))
def test_every_objective_binds_from_the_schemas_values_and_runs_on_one_call(objective):
    fn = registry.bind_objective(
        objective, params(objective), aggregation=Aggregation.TOKEN_MEAN, norm_len=None
    )
    assert set(batch()) == set(registry.OBJECTIVE_CALL)
    out = fn(**batch())
    assert isinstance(out, LossOutput)
    assert torch.isfinite(out.loss)


def test_bound_hyperparameters_reach_the_function():
    b = batch()
    agg = {"aggregation": Aggregation.TOKEN_MEAN, "norm_len": None}
    tight = registry.bind_objective(
        Objective.PPO_CLIP, {"clip_eps_low": 0.0, "clip_eps_high": 0.0, "dual_clip_c": None}, **agg
    )
    loose = registry.bind_objective(
        Objective.PPO_CLIP, {"clip_eps_low": 1.0, "clip_eps_high": 100.0, "dual_clip_c": None}, **agg
    )
    assert not torch.allclose(tight(**b).loss, loose(**b).loss)


TOKEN = {"aggregation": Aggregation.TOKEN_MEAN, "norm_len": None}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: registry.bind_objective("ppo_clip", params(Objective.PPO_CLIP), **TOKEN),
         "algo.objective must be a member of Objective.*got 'ppo_clip' \\(str\\)"),
        (lambda: registry.bind_objective(Objective.PPO_CLIP, params(Objective.GSPO), **TOKEN),
         "binds hyper-parameters \\['clip_eps_high', 'clip_eps_low', 'dual_clip_c'\\]"),
        (lambda: registry.bind_objective(
            Objective.PPO_CLIP, params(Objective.PPO_CLIP), aggregation=Aggregation.SEQ_MEAN_GROUP_MEAN,
            norm_len=None), "algo.aggregation must be one of .* for algo.objective=ppo_clip"),
        (lambda: registry.bind_advantage("grpo"), "algo.advantage must be a member of Advantage"),
        (lambda: registry.bind_kl_loss("k3", 0.1, Aggregation.TOKEN_MEAN, None), "algo.kl.estimator must be"),
        (lambda: registry.bind_corrections(sections(tis={"mode": "token"}), PolicyMode.DECOUPLED),
         "algo.corrections.tis.mode must be a member of TISMode"),
        (lambda: registry.bind_corrections(
            sections(rejection={"enabled": True, "divergence": "k2"}), PolicyMode.DECOUPLED),
         "algo.corrections.rejection.divergence must be a member of Divergence"),
        (lambda: registry.bind_corrections(sections(), "bypass"), "algo.policy_mode must be a member of PolicyMode"),
        (lambda: registry.bind_corrections({**sections(), "ksm": {}}, PolicyMode.DECOUPLED),
         "algo.corrections binds sections"),
    ],
    ids=["objective-str", "hparams", "aggregation", "advantage-str", "kl-str", "tis-str", "divergence-str",
         "policy-mode-str", "section"],
)  # fmt: skip
def test_registry_refuses_strings_and_values_it_does_not_bind(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_keyword_the_function_lacks_is_refused_when_the_recipe_is_resolved(monkeypatch):
    """A recipe value declared for a function that has no such keyword (here the dual-clip floor
    for CISPO, which has no dual clip) stops the binding; it is never dropped at the call."""
    cispo = (*registry.OBJECTIVE_PARAMS[Objective.CISPO], "dual_clip_c")
    monkeypatch.setitem(registry.OBJECTIVE_PARAMS, Objective.CISPO, cispo)
    with pytest.raises(
        ValueError,
        match=r"objective 'cispo' \(moe_rl.algo.objectives.cispo\) does not take \['dual_clip_c'\]",
    ):
        registry.bind_objective(Objective.CISPO, params(Objective.CISPO), **TOKEN)
    with pytest.raises(ValueError, match=r"algo.corrections.tis \(.*token_tis\) does not take \['cap2'\]"):
        registry.bind_corrections(sections(tis={"mode": TISMode.TOKEN, "cap2": 1.0}), PolicyMode.DECOUPLED)


def test_bind_checks_the_declaration_against_the_signature():
    what = "opsm"
    inputs = registry.CORRECTION_FUNCS["opsm"][1]
    with pytest.raises(ValueError, match=r"needs \['delta'\], which nothing passes"):
        registry.bind(corrections.opsm_mask, {}, inputs, what)
    with pytest.raises(ValueError, match=r"does not take \['old_logp'\]"):
        registry.bind(corrections.opsm_mask, {"delta": 0.1}, (*inputs, "old_logp"), what)
    with pytest.raises(ValueError, match=r"\['delta'\] both bound and read"):
        registry.bind(corrections.opsm_mask, {"delta": 0.1}, (*inputs, "delta"), what)
    with pytest.raises(ValueError, match=r"reads \['advantages'\], which its call"):
        registry.bind(corrections.opsm_mask, {"delta": 0.1}, inputs, what, call=set(inputs) - {"advantages"})


def test_a_call_names_what_is_missing_and_refuses_what_is_outside_it():
    fn = registry.bind_objective(Objective.ESPO, params(Objective.ESPO), **TOKEN)
    b = batch()
    del b["entropy"], b["vocab_size"]
    with pytest.raises(ValueError, match="needs inputs \\['entropy', 'vocab_size'\\]"):
        fn(**b)
    with pytest.raises(TypeError, match=r"not \['token_weights'\]"):
        fn(**batch(), token_weights=None)


def spy(monkeypatch, module, name: str) -> dict:
    """Record the keywords `module.name` is called with (it still runs)."""
    seen: dict = {}
    real = getattr(module, name)

    @functools.wraps(real)
    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


def test_a_typed_mode_reaches_the_function_as_its_member(monkeypatch):
    rejection = spy(monkeypatch, corrections, "rejection_mask")
    policy = spy(monkeypatch, corrections, "resolve_old_logp")
    espo = spy(monkeypatch, objectives, "espo")
    stack = registry.bind_corrections(
        sections(rejection={"enabled": True, "divergence": Divergence.K2,
                            "aggregation": RejectionAggregation.TOKEN, "low": 0.0, "high": 0.01}),
        PolicyMode.BYPASS,
    )  # fmt: skip
    b = batch()
    stack(
        logp=b["logp"], old_logp=b["old_logp"], rollout_logp=b["old_logp"], advantages=b["advantages"],
        loss_mask=b["loss_mask"], seq_ids=b["seq_ids"], num_seqs=2,
    )  # fmt: skip
    registry.bind_objective(
        Objective.ESPO, params(Objective.ESPO), aggregation=Aggregation.SEQ_MEAN_GROUP_MEAN, norm_len=None
    )(**b)
    assert rejection["divergence"] is Divergence.K2
    assert rejection["aggregation"] is RejectionAggregation.TOKEN
    assert policy["mode"] is PolicyMode.BYPASS
    assert espo["aggregation"] is Aggregation.SEQ_MEAN_GROUP_MEAN


def test_advantage_and_kl_bindings():
    rewards, groups = t([1.0, 0.0]), torch.tensor([0, 0])
    adv = registry.bind_advantage(Advantage.RLOO)(rewards=rewards, group_ids=groups)
    torch.testing.assert_close(adv, t([1.0, -1.0]))  # each against the other's reward
    kl = registry.bind_kl_loss(KLEstimator.K3_IS, 0.5, Aggregation.TOKEN_MEAN, None)
    zero = t([0.0])
    out = kl(logp=zero, ref_logp=zero, old_logp=zero, loss_mask=torch.ones(1, dtype=torch.bool),
             seq_ids=torch.tensor([0]), num_seqs=1)  # fmt: skip
    assert out.loss_sum.item() == 0.0
    with pytest.raises(ValueError, match="needs inputs \\['group_ids'\\]"):
        registry.bind_advantage(Advantage.GRPO)(rewards=rewards)


def test_a_steps_advantages_are_dgos_weights_for_dgo_and_the_estimators_otherwise():
    """`bind_step_advantage`: DGO's sample weights ``exp(r/β) / mean_group exp(r/β)`` with the recipe's
    β, whatever ``algo.advantage`` says; any other objective, the estimator's driver part."""
    rewards, groups = t([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    dgo = registry.bind_step_advantage(Objective.DGO, Advantage.RLOO, 0.5)
    e = math.exp(2.0)  # exp(1 / 0.5) against exp(0)
    torch.testing.assert_close(
        dgo(rewards=rewards, group_ids=groups), t([2 * e / (e + 1), 2 / (e + 1), 1.0, 1.0]).float()
    )
    assert dgo.values == {"dgo_beta": 0.5}
    rloo = registry.bind_step_advantage(Objective.PPO_CLIP, Advantage.RLOO, 0.5)
    torch.testing.assert_close(rloo(rewards=rewards, group_ids=groups), t([1.0, -1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="algo.objective must be a member of Objective"):
        registry.bind_step_advantage("dgo", Advantage.RLOO, 0.5)


def test_sft_weighs_every_sample_1_and_trains_as_reinforce_with_advantage_1():
    """`Objective.SFT`: the driver's weights are 1 whatever the rewards and groups; the trainer's
    loss is REINFORCE's with those advantages, the negative log-likelihood of the responses."""
    from moe_rl.algo.objectives import sft

    rewards, groups = t([1.0, 0.0, 2.0, -3.0]), torch.tensor([0, 0, 1, 2])
    weights = registry.bind_step_advantage(Objective.SFT, Advantage.RLOO, 0.5)
    assert weights.values == {}
    torch.testing.assert_close(weights(rewards=rewards, group_ids=groups), torch.ones(4))
    algo = {"clip_eps_low": 0.2, "dgo_beta": 0.5}
    trained = registry.bind_recipe_objective(Objective.SFT, algo, Aggregation.SEQ_MEAN_TOKEN_SUM, None)
    reinforce = registry.bind_recipe_objective(
        Objective.REINFORCE, algo, Aggregation.SEQ_MEAN_TOKEN_SUM, None
    )
    logp, mask = t([-0.5, -1.0, -2.0, -0.25, -4.0]), torch.tensor([True, True, False, True, True])
    seq_ids, ones = torch.tensor([0, 0, 0, 1, 1]), torch.ones(5)  # each token its sample's advantage
    call = dict(logp=logp, loss_mask=mask, seq_ids=seq_ids, num_seqs=2, weights=None)
    out = trained(**call, advantages=ones)
    assert out.loss_sum.item() == pytest.approx(1.5 + 4.25) and float(out.denom) == 2
    assert out.loss_sum.item() == reinforce(**call, advantages=ones).loss_sum.item()
    direct = sft(logp, mask, seq_ids, num_seqs=2, aggregation="seq_mean_token_sum")
    assert direct.loss_sum.item() == out.loss_sum.item() and float(direct.denom) == 2
    assert registry.OBJECTIVE_PARAMS[Objective.SFT] == ()


def test_correction_stack_from_the_recipes_sections():
    stack = registry.bind_corrections(
        sections(
            tis={"mode": TISMode.TOKEN, "cap": 2.0},
            icepop={"enabled": True, "low": 0.5, "high": 5.0},
            rejection={"enabled": True, "divergence": Divergence.K1, "aggregation": RejectionAggregation.TOKEN,
                       "low": 0.2, "high": 5.0},
            opsm={"enabled": True, "delta": 0.1},
        ),
        PolicyMode.DECOUPLED,
    )  # fmt: skip
    assert [s.func.__name__ for s in stack.steps] == ["token_tis", "icepop", "rejection_mask", "opsm_mask"]
    old = t([math.log(1.5), math.log(6.0), math.log(0.1), 0.0])
    roll = t([0.0] * 4)
    logp = t([0.0, 0.0, 0.0, -1.0])  # response 1 drifted by 0.5 and has A < 0 → OPSM
    out = stack(
        logp=logp, old_logp=old, rollout_logp=roll, advantages=t([1.0, 1.0, -1.0, -1.0]),
        loss_mask=torch.ones(4, dtype=torch.bool), seq_ids=seq_ids_for([2, 2]), num_seqs=2,
    )  # fmt: skip
    torch.testing.assert_close(out.weights, t([1.5 * 1.5, 0.0, 0.0, 1.0]))  # TIS × IcePop
    assert out.mask.tolist() == [True, False, False, False]  # rejection 1/6, then OPSM on response 1
    bypass = registry.bind_corrections(sections(tis={"mode": TISMode.SEQ}), PolicyMode.BYPASS)
    assert [s.func.__name__ for s in bypass.steps] == ["seq_tis"]
    assert bypass.old_logp(old, roll) is roll
    assert registry.bind_corrections(sections(), PolicyMode.DECOUPLED).steps == ()


def test_config_objects_are_refused():
    with pytest.raises(TypeError, match="plain dict"):
        registry.bind_objective(Objective.PPO_CLIP, AlgoConfig(), **TOKEN)
