"""The stability stack's loss, ESPO with its own aggregation (`algo.aggregation=seq_mean_group_mean`),
is ESPO as the paper writes it: computed here by hand (plain Python, per response and entropy group) and
compared with the function the trainer binds from the recipe, and with the trainer's micro-batch loss,
where the stack's corrections (IcePop, OPSM) weigh and mask the tokens first."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_rl.algo import registry
from moe_rl.algo.modes import Aggregation, Objective
from moe_rl.config import ConfigError
from moe_rl.data import Sample, TrajectoryBatch
from moe_rl.orchestration.preflight import load_checked
from moe_rl.trainer.batch import make_train_micro_batches
from moe_rl.trainer.loss import TrainerLoss
from moe_rl.trainer.passes import Timer

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"

# Two responses: 5 and 4 tokens (ρ = 0.2 → ⌈0.2·5⌉ = 1 and ⌈0.2·4⌉ = 1 top-entropy token each).
LOGP = [-0.9, -1.2, -0.3, -2.0, -0.7, -1.1, -0.4, -1.6, -0.8]
OLD = [-1.0, -1.0, -0.5, -1.5, -0.9, -1.0, -0.6, -1.9, -0.7]
ENTROPY = [0.5, 2.5, 0.7, 0.4, 1.1, 1.9, 0.3, 0.6, 2.2]
ADV = [1.0] * 5 + [-0.5] * 4
SEQ = [0] * 5 + [1] * 4
# The engine's log-probs: engine ratios ρ_t = exp(OLD − ROLLOUT) of e^0.2, e^−0.2, e^2 (outside IcePop's
# band [0.5, 5]), 1, e^1.1 (above TIS's cap 2) | e^−0.1, e^0.1, e^−0.2, e^0.1. Drift of response 1,
# mean(ROLLOUT − LOGP) = (0.2 − 0.3 − 0.1 + 0)/4 = −0.05: within OPSM's δ = 0.1.
ROLLOUT = [-1.2, -0.8, -2.5, -1.5, -2.0, -0.9, -0.7, -1.7, -0.8]


def icepop_weight(t: int) -> float:
    rho = math.exp(OLD[t] - ROLLOUT[t])
    return rho if 0.5 <= rho <= 5.0 else 0.0


def tis_weight(t: int) -> float:
    return min(math.exp(OLD[t] - ROLLOUT[t]), 2.0)


def by_hand(alpha: float, rho: float, vocab: int, logp=LOGP, adv=ADV, weights=None, keep=None) -> float:
    """ESPO (docs/algorithms.md, "espo"): entropy groups per response, ℓ_τ = mean(logp − old),
    s_t = exp(ℓ_τ) in value, ε_τ = α·mean(e)/log|V|, l_t = −w_t·min(s·A, clip(s, 1 ± ε)·A); token-mean
    in a group, mean of the groups, mean of the responses. ``keep``: the tokens a correction's mask
    leaves (only they are ranked, grouped and counted); a response with none adds 0 and still
    counts in the mean over responses."""
    weights = weights or [1.0] * len(SEQ)
    per_response = []
    for seq in (0, 1):
        tokens = [t for t, s in enumerate(SEQ) if s == seq and (keep is None or keep[t])]
        top = sorted(tokens, key=lambda t: -ENTROPY[t])[: math.ceil(rho * len(tokens))]
        groups = [g for g in (top, [t for t in tokens if t not in top]) if g]
        means = []
        for group in groups:
            ell = sum(logp[t] - OLD[t] for t in group) / len(group)
            eps = alpha * sum(ENTROPY[t] for t in group) / len(group) / math.log(vocab)
            s = math.exp(ell)
            losses = [-weights[t] * min(s * adv[t], min(max(s, 1 - eps), 1 + eps) * adv[t]) for t in group]
            means.append(sum(losses) / len(losses))
        per_response.append(sum(means) / len(means) if means else 0.0)
    return sum(per_response) / 2


def micro_loss(config, logp: list[float], adv: list[float]) -> tuple[float, dict]:
    """The trainer's loss on one micro-batch of the two responses (`TrainerLoss.micro_loss` over
    its divisor), with π_old's log-probs and entropies as the π_old pass attaches them."""
    samples = [
        Sample(torch.tensor([1, 2]), torch.tensor([3] * n), torch.tensor(ROLLOUT[a : a + n]), 0.0, 0, "stop",
               [(0, 0)])
        for a, n in ((0, 5), (5, 4))
    ]  # fmt: skip
    batch = TrajectoryBatch.from_samples(samples, engine="vllm", quant_recipe="bf16", policy_version=0)
    (mb,) = make_train_micro_batches(batch, torch.tensor(adv), 64, num_microbatches=1)
    idx = mb.micro.response_token_index  # packed order of the response tokens
    f64 = torch.float64
    mb = mb.with_old(
        old_logp=torch.tensor(OLD, dtype=f64)[idx], old_entropy=torch.tensor(ENTROPY, dtype=f64)[idx]
    )
    loss = TrainerLoss.of(config)
    loss_sum, metrics = loss.micro_loss(mb, torch.tensor(logp, dtype=f64)[idx], Timer())
    return float(loss_sum / loss.local_denominator(mb, loss_sum.device)), metrics


def test_the_stability_stack_trains_espo_with_its_own_aggregation():
    config = load_checked(TINY, [])  # the tiny recipe includes recipes/algo/stability_stack.yaml
    a = config.algo
    assert (a.objective, a.aggregation) == (Objective.ESPO, Aggregation.SEQ_MEAN_GROUP_MEAN)
    loss_fn = TrainerLoss.of(config).objective
    tensors = {
        "logp": torch.tensor(LOGP, dtype=torch.float64, requires_grad=True),
        "old_logp": torch.tensor(OLD, dtype=torch.float64),
        "advantages": torch.tensor(ADV, dtype=torch.float64),
        "entropy": torch.tensor(ENTROPY, dtype=torch.float64),
        "loss_mask": torch.ones(9, dtype=torch.bool),
        "seq_ids": torch.tensor(SEQ),
    }
    out = loss_fn(**tensors, num_seqs=2, weights=None, vocab_size=config.model.vocab_size)
    want = by_hand(a.espo_alpha, a.espo_rho, config.model.vocab_size)
    assert float(out.loss_sum / out.denom) == pytest.approx(want, rel=1e-12)
    assert float(out.denom) == 2.0  # the mean over responses
    token_mean = load_checked(TINY, ["algo.aggregation=token_mean"])
    other = TrainerLoss.of(token_mean).objective(**tensors, num_seqs=2, weights=None, vocab_size=16)
    assert float(other.loss_sum / other.denom) != pytest.approx(want, rel=1e-3)  # the choice matters


def test_a_recipe_value_the_objective_does_not_take_stops_the_loss_at_start(monkeypatch):
    """The trainer hands the registry every recipe value its table names for the objective; one the
    function lacks (a PPO clip for ESPO, whose clip is its own) fails `TrainerLoss.of`, before any
    step, rather than being dropped from every call."""
    config = load_checked(TINY, [])
    espo = (*registry.OBJECTIVE_PARAMS[Objective.ESPO], "clip_eps_low")
    monkeypatch.setitem(registry.OBJECTIVE_PARAMS, Objective.ESPO, espo)
    with pytest.raises(ValueError, match=r"objective 'espo' .* does not take \['clip_eps_low'\]"):
        TrainerLoss.of(config)


@pytest.mark.parametrize(
    ("overrides", "weight"),
    [
        ([], icepop_weight),
        (["algo.corrections.icepop.enabled=false", "algo.corrections.tis.mode=token"], tis_weight),
    ],
    ids=["icepop", "tis"],
)
def test_the_stack_weighs_espos_group_means_per_token_by_the_corrections(overrides, weight):
    config = load_checked(TINY, overrides)
    a, vocab = config.algo, config.model.vocab_size
    got, metrics = micro_loss(config, LOGP, ADV)
    want = by_hand(a.espo_alpha, a.espo_rho, vocab, weights=[weight(t) for t in range(9)])
    assert got == pytest.approx(want, rel=1e-6)
    assert want != pytest.approx(by_hand(a.espo_alpha, a.espo_rho, vocab), rel=1e-3)  # the weights matter
    assert float(metrics["opsm_masked_token_frac"]) == 0.0


@pytest.mark.parametrize(
    ("adv1", "keep1", "masked_seq_frac"),
    [([-0.5] * 4, [False] * 4, 0.5), ([-0.5, 0.0, 1.0, 0.0], [False, True, True, True], 0.0)],
    ids=["negative-response", "zero-advantage-tokens-stay"],
)
def test_the_stacks_opsm_masks_the_negative_tokens_of_a_drifted_response(adv1, keep1, masked_seq_frac):
    """Response 1 drifted (logp 0.4 lower: mean(ROLLOUT − logp) = 0.35 > δ): OPSM masks its tokens with
    A < 0; tokens with A = 0 stay counted in their entropy group (RL-ZVP's per-token advantages)."""
    config = load_checked(TINY, [])
    a, vocab = config.algo, config.model.vocab_size
    logp = LOGP[:5] + [x - 0.4 for x in LOGP[5:]]
    adv = ADV[:5] + adv1
    got, metrics = micro_loss(config, logp, adv)
    weights = [icepop_weight(t) for t in range(9)]
    want = by_hand(a.espo_alpha, a.espo_rho, vocab, logp, adv, weights, [True] * 5 + keep1)
    assert got == pytest.approx(want, rel=1e-6)
    assert float(metrics["opsm_masked_seq_frac"]) == masked_seq_frac


def test_espos_aggregation_is_refused_for_other_objectives():
    with pytest.raises(ConfigError, match="algo.aggregation=seq_mean_group_mean is ESPO's own"):
        load_checked(TINY, ["algo.objective=ppo_clip"])  # the stack's aggregation, another objective


def test_dr_grpo_constant_normalizer_is_the_recipes_max_new_tokens():
    """`seq_mean_token_sum_norm` (Dr.GRPO): Σ_t l_t / L per response, L = rollout.max_new_tokens,
    mean over responses; REINFORCE's token loss is −A·logp."""
    config = load_checked(TINY, ["algo.objective=reinforce", "algo.aggregation=seq_mean_token_sum_norm"])
    length = config.rollout.max_new_tokens
    out = TrainerLoss.of(config).objective(
        logp=torch.tensor(LOGP, dtype=torch.float64, requires_grad=True),
        old_logp=torch.tensor(OLD, dtype=torch.float64),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        loss_mask=torch.ones(9, dtype=torch.bool),
        seq_ids=torch.tensor(SEQ),
        num_seqs=2,
        weights=None,
    )
    per_response = [sum(-ADV[t] * LOGP[t] for t, s in enumerate(SEQ) if s == seq) / length for seq in (0, 1)]
    assert float(out.loss_sum / out.denom) == pytest.approx(sum(per_response) / 2, rel=1e-12)


@pytest.mark.parametrize(("c", "capped"), [(3.0, True), (1.0, False), (0.0, False)])
def test_a_recipe_turns_dual_clip_off_with_c_at_most_one(c, capped):
    """PPO-clip with a negative advantage and ratio 10: dual clip caps the token loss at −c·A."""
    config = load_checked(
        TINY, ["algo.objective=ppo_clip", "algo.aggregation=token_mean", f"algo.dual_clip_c={c}"]
    )
    out = TrainerLoss.of(config).objective(
        logp=torch.tensor([math.log(10.0)], dtype=torch.float64),
        old_logp=torch.tensor([0.0], dtype=torch.float64),
        advantages=torch.tensor([-1.0], dtype=torch.float64),
        loss_mask=torch.ones(1, dtype=torch.bool),
        seq_ids=torch.tensor([0]),
        num_seqs=1,
        weights=None,
    )
    assert float(out.loss_sum / out.denom) == pytest.approx(3.0 if capped else 10.0)
