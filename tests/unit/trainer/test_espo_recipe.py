"""The stability stack's loss, ESPO with its own aggregation (`algo.aggregation=seq_mean_group_mean`),
is ESPO as the paper writes it: computed here by hand (plain Python, per response and entropy group) and
compared with the function the trainer binds from the recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError
from moe_rl.orchestration.preflight import load_checked
from moe_rl.trainer.loss import TrainerLoss

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"

# Two responses: 5 and 4 tokens (ρ = 0.2 → ⌈0.2·5⌉ = 1 and ⌈0.2·4⌉ = 1 top-entropy token each).
LOGP = [-0.9, -1.2, -0.3, -2.0, -0.7, -1.1, -0.4, -1.6, -0.8]
OLD = [-1.0, -1.0, -0.5, -1.5, -0.9, -1.0, -0.6, -1.9, -0.7]
ENTROPY = [0.5, 2.5, 0.7, 0.4, 1.1, 1.9, 0.3, 0.6, 2.2]
ADV = [1.0] * 5 + [-0.5] * 4
SEQ = [0] * 5 + [1] * 4


def by_hand(alpha: float, rho: float, vocab: int) -> float:
    """ESPO (docs/algorithms.md, "espo"): entropy groups per response, ℓ_τ = mean(logp − old),
    s_t = exp(ℓ_τ) in value, ε_τ = α·mean(e)/log|V|, l_t = −min(s·A, clip(s, 1 ± ε)·A); token-mean
    in a group, mean of the groups, mean of the responses."""
    per_response = []
    for seq in (0, 1):
        tokens = [t for t, s in enumerate(SEQ) if s == seq]
        top = sorted(tokens, key=lambda t: -ENTROPY[t])[: math.ceil(rho * len(tokens))]
        groups = [top, [t for t in tokens if t not in top]]
        means = []
        for group in groups:
            ell = sum(LOGP[t] - OLD[t] for t in group) / len(group)
            eps = alpha * sum(ENTROPY[t] for t in group) / len(group) / math.log(vocab)
            s = math.exp(ell)
            losses = [-min(s * ADV[t], min(max(s, 1 - eps), 1 + eps) * ADV[t]) for t in group]
            means.append(sum(losses) / len(losses))
        per_response.append(sum(means) / len(means))
    return sum(per_response) / len(per_response)


def test_the_stability_stack_trains_espo_with_its_own_aggregation():
    config = load_checked(TINY, [])  # the tiny recipe includes recipes/algo/stability_stack.yaml
    a = config.algo
    assert (a.objective, a.aggregation) == ("espo", "seq_mean_group_mean")
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
