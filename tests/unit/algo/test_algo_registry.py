"""moe_rl.algo.registry: recipe names → bound functions; plain dicts in, no config objects."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.algo import aggregate, corrections, kl, registry
from moe_rl.algo.objectives import LossOutput
from tests.unit.algo.algo_testing import seq_ids_for, t

REPO = Path(__file__).resolve().parents[3]


def test_registry_imports_without_torch():
    code = (
        "import sys; import moe_rl.algo.registry as r; assert 'torch' not in sys.modules; print(r.OBJECTIVES)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "ppo_clip" in out.stdout


def test_name_tables_match_the_math_modules():
    assert registry.AGGREGATIONS == aggregate.AGGREGATIONS
    assert registry.KL_ESTIMATORS == kl.KL_ESTIMATORS
    assert registry.TIS_MODES == corrections.TIS_MODES
    assert registry.REJECTION_DIVERGENCES == corrections.REJECTION_DIVERGENCES
    assert registry.REJECTION_AGGREGATIONS == corrections.REJECTION_AGGREGATIONS
    assert set(registry.OBJECTIVE_PARAMS) == set(registry.OBJECTIVES) == set(registry.DEFAULT_AGGREGATION)


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
        "vocab_size": 100,
        "rewards": t([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]),
    }


@pytest.mark.parametrize("name", registry.OBJECTIVES)
def test_every_objective_binds_and_runs_on_one_batch_dict(name):
    fn = registry.bind_objective(name, {})
    out = fn(**batch())
    assert isinstance(out, LossOutput)
    assert torch.isfinite(out.loss)


def test_bound_hyperparameters_reach_the_function():
    b = batch()
    tight = registry.bind_objective(
        "ppo_clip", {"clip_eps_low": 0.0, "clip_eps_high": 0.0, "dual_clip_c": None}
    )
    loose = registry.bind_objective("ppo_clip", clip_eps_low=1.0, clip_eps_high=100.0, dual_clip_c=None)
    assert not torch.allclose(tight(**b).loss, loose(**b).loss)


def test_objective_params_fill_defaults_and_ignore_other_objectives_keys():
    got = registry.objective_params("espo", {"espo_alpha": 0.05, "clip_eps_low": 0.1})
    assert got == {"espo_rho": 0.2, "espo_num_groups": 2, "espo_alpha": 0.05}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: registry.bind_objective("ppo"), "algo.objective must be one of"),
        (lambda: registry.bind_objective("ppo_clip", {"clip_eps": 0.2}), "unknown objective hyper-parameters"),
        (lambda: registry.bind_objective("ppo_clip", aggregation="mean"), "algo.aggregation must be one of"),
        (lambda: registry.bind_advantage("gae"), "algo.advantage must be one of"),
        (lambda: registry.bind_advantage("rloo", eps=0.1), "unknown hyper-parameters"),
        (lambda: registry.bind_kl("k4"), "algo.kl.estimator must be one of"),
        (lambda: registry.bind_corrections({"tis": {"mode": "both"}}), "tis.mode must be one of"),
        (lambda: registry.bind_corrections({"tis": {"cap2": 1}}), "unknown correction keys"),
        (lambda: registry.bind_corrections({"opsm": {"enabled": True}}), "opsm.delta must be set"),
        (lambda: registry.bind_corrections({"rejection": {"divergence": "kl"}}), "rejection.divergence"),
        (lambda: registry.bind_corrections({"rejection": {"aggregation": "mean"}}), "rejection.aggregation"),
    ],
    ids=["objective", "hparam", "aggregation", "advantage", "advantage-hparam", "kl", "tis-mode",
         "correction-key", "opsm-delta", "rejection-divergence", "rejection-aggregation"],
)  # fmt: skip
def test_registry_rejects_unknown_names(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="needs inputs \\['entropy', 'vocab_size'\\]"):
        fn = registry.bind_objective("espo")
        b = batch()
        del b["entropy"], b["vocab_size"]
        fn(**b)


def test_advantage_aggregation_and_kl_bindings():
    adv = registry.bind_advantage("grpo", {"eps": 0.0})(rewards=t([1.0, 0.0]), group_ids=torch.tensor([0, 0]))
    torch.testing.assert_close(adv, t([1 / math.sqrt(2), -1 / math.sqrt(2)]))
    b = batch()
    _, d = registry.bind_aggregation("token_mean")(
        token_loss=b["logp"], **{k: b[k] for k in ("loss_mask", "seq_ids", "num_seqs")}
    )
    assert d.item() == 7
    k3 = registry.bind_kl("k3_is")(logp=t([0.0]), ref_logp=t([0.0]), old_logp=t([0.0]))
    assert k3.item() == 0.0


def test_correction_stack_from_nested_dict():
    stack = registry.bind_corrections(
        {
            "mode": "decoupled",
            "tis": {"mode": "token", "cap": 2.0},
            "icepop": {"enabled": True, "low": 0.5, "high": 5.0},
            "rejection": {
                "enabled": True,
                "divergence": "k1",
                "aggregation": "token",
                "low": 0.2,
                "high": 5.0,
            },
            "opsm": {"enabled": True, "delta": 0.1},
        }
    )
    old = t([math.log(1.5), math.log(6.0), math.log(0.1), 0.0])
    roll = t([0.0] * 4)
    logp = t([0.0, 0.0, 0.0, -1.0])  # response 1 drifted by 0.5 and has A < 0 → OPSM
    out = stack(
        logp=logp, old_logp=old, rollout_logp=roll, advantages=t([1.0, 1.0, -1.0, -1.0]),
        loss_mask=torch.ones(4, dtype=torch.bool), seq_ids=seq_ids_for([2, 2]), num_seqs=2,
    )  # fmt: skip
    torch.testing.assert_close(out.weights, t([1.5 * 1.5, 0.0, 0.0, 1.0]))  # TIS × IcePop
    assert out.mask.tolist() == [True, False, False, False]  # rejection 1/6, then OPSM on response 1
    bypass = registry.bind_corrections(mode="bypass", tis_mode="seq")
    assert bypass.old_logp(old, roll) is roll


def test_config_objects_are_refused():
    class AlgoConfig:
        clip_eps_low = 0.2

    with pytest.raises(TypeError, match="plain dict"):
        registry.bind_objective("ppo_clip", AlgoConfig())
