"""Hypothesis properties of moe_rl.algo: finiteness at extreme log-probs, masks only remove,
aggregation is independent of how a batch is split across ranks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.algo import corrections, diagnostics, kl, objectives
from moe_rl.algo.aggregate import AGGREGATIONS, aggregate, local_denominator

SETTINGS = settings(max_examples=30, deadline=None)
LOGP = st.floats(-80.0, 80.0, allow_nan=False)


@st.composite
def packed_batch(draw, max_seqs: int = 5, max_len: int = 6):
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    n = sum(lengths)

    def vec(elements):
        return torch.tensor(draw(st.lists(elements, min_size=n, max_size=n)), dtype=torch.float64)

    return {
        "lengths": lengths,
        "seq_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        "num_seqs": len(lengths),
        "logp": vec(LOGP),
        "old_logp": vec(LOGP),
        "rollout_logp": vec(LOGP),
        "advantages": vec(st.floats(-10.0, 10.0)),
        "entropy": vec(st.floats(0.0, 12.0)),
        "loss_mask": torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
    }


def _objective_outputs(b):
    common = {"loss_mask": b["loss_mask"], "seq_ids": b["seq_ids"], "num_seqs": b["num_seqs"]}
    lp, old, adv = b["logp"], b["old_logp"], b["advantages"]
    yield "ppo_clip", objectives.ppo_clip(lp, old, adv, **common)
    yield "gspo", objectives.gspo(lp, old, adv, **common)
    yield "gspo_token", objectives.gspo_token(lp, old, adv, **common)
    yield "cispo", objectives.cispo(lp, old, adv, **common)
    yield "reinforce", objectives.reinforce(lp, adv, **common)
    yield "espo", objectives.espo(lp, old, adv, b["entropy"], **common, vocab_size=1000)


@SETTINGS
@given(b=packed_batch())
def test_objectives_finite_with_finite_gradients_at_extreme_log_probs(b):
    b["logp"].requires_grad_()
    for name, out in _objective_outputs(b):
        assert torch.isfinite(out.loss_sum), name
        (g,) = torch.autograd.grad(out.loss_sum, b["logp"], allow_unused=True)
        assert g is None or torch.isfinite(g).all(), name


@SETTINGS
@given(b=packed_batch())
def test_corrections_kl_and_diagnostics_finite_at_extreme_log_probs(b):
    old, roll, mask, seq, s = b["old_logp"], b["rollout_logp"], b["loss_mask"], b["seq_ids"], b["num_seqs"]
    weights = [
        corrections.token_tis(old, roll, mask, cap=math.inf).weights,
        corrections.seq_tis(old, roll, mask, seq, num_seqs=s, cap=math.inf).weights,
        corrections.icepop(old, roll, mask).weights,
    ]
    assert all(torch.isfinite(w).all() for w in weights)
    for est in kl.KL_ESTIMATORS:
        assert torch.isfinite(kl.kl_penalty(b["logp"], old, estimator=est, old_logp=roll)).all(), est
    for name, value in diagnostics.mismatch_metrics(old, roll, mask, seq, num_seqs=s).items():
        assert torch.isfinite(value), name


@SETTINGS
@given(
    b=packed_batch(),
    divergence=st.sampled_from(corrections.REJECTION_DIVERGENCES),
    aggregation=st.sampled_from(corrections.REJECTION_AGGREGATIONS),
    low=st.floats(0.0, 1.0),
    width=st.floats(0.0, 10.0),
    delta=st.floats(-1.0, 1.0),
)
def test_masks_never_re_enable_a_token(b, divergence, aggregation, low, width, delta):
    old, roll, mask, seq, s = b["old_logp"], b["rollout_logp"], b["loss_mask"], b["seq_ids"], b["num_seqs"]
    # shrink the log-ratios so that both outcomes occur
    old = roll + (old - roll) / 100
    rej = corrections.rejection_mask(
        old,
        roll,
        mask,
        seq,
        num_seqs=s,
        divergence=divergence,
        aggregation=aggregation,
        low=low,
        high=low + width,
    )
    opsm = corrections.opsm_mask(
        b["logp"] / 100, roll / 100, b["advantages"], mask, seq, num_seqs=s, delta=delta
    )
    tis = corrections.token_tis(old, roll, mask)
    ice = corrections.icepop(old, roll, mask)
    both = corrections.combine(mask, tis, ice, rej, opsm)
    for out in (rej, opsm, both):
        assert not (out.mask & ~mask).any()
    for out in (tis, ice, both, corrections.seq_tis(old, roll, mask, seq, num_seqs=s)):
        assert torch.all(out.weights[~mask] == 0)


def _take(b, seqs: list[int]):
    """The sub-batch of responses `seqs` (renumbered 0..k−1), as a data-parallel rank would hold it."""
    remap = {old: new for new, old in enumerate(seqs)}
    keep = torch.tensor([int(i) in remap for i in b["seq_ids"]], dtype=torch.bool)
    sub = {k: v[keep] for k, v in b.items() if isinstance(v, torch.Tensor)}
    sub["seq_ids"] = torch.tensor([remap[int(i)] for i in b["seq_ids"][keep]], dtype=torch.long)
    sub["num_seqs"] = len(seqs)
    return sub


@SETTINGS
@given(b=packed_batch(max_seqs=6), rank_of_seq=st.lists(st.integers(0, 2), min_size=6, max_size=6))
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_equal_under_any_split_given_the_global_denominator(b, rank_of_seq, mode):
    token_loss = b["advantages"]
    full_sum, full_denom = aggregate(
        token_loss, b["loss_mask"], b["seq_ids"], num_seqs=b["num_seqs"], mode=mode, norm_len=8
    )
    ranks = [[i for i in range(b["num_seqs"]) if rank_of_seq[i] == r] for r in range(3)]
    parts = [_take(b, seqs) for seqs in ranks]
    global_denom = sum(
        local_denominator(p["loss_mask"], p["seq_ids"], num_seqs=p["num_seqs"], mode=mode) for p in parts
    )
    total = sum(
        aggregate(
            p["advantages"], p["loss_mask"], p["seq_ids"], num_seqs=p["num_seqs"], mode=mode,
            global_denom=global_denom, norm_len=8,
        )[0]
        for p in parts
    )  # fmt: skip
    assert global_denom == full_denom
    if full_denom > 0:
        torch.testing.assert_close(total / global_denom, full_sum / full_denom)


@SETTINGS
@given(b=packed_batch(max_seqs=6), rank_of_seq=st.lists(st.integers(0, 1), min_size=6, max_size=6))
def test_espo_group_mean_equal_under_any_split(b, rank_of_seq):
    def run(p, denom=None):
        return objectives.espo(
            p["logp"] / 100, p["old_logp"] / 100, p["advantages"], p["entropy"], p["loss_mask"], p["seq_ids"],
            num_seqs=p["num_seqs"], vocab_size=1000, global_denom=denom,
        )  # fmt: skip

    full = run(b)
    parts = [_take(b, [i for i in range(b["num_seqs"]) if rank_of_seq[i] == r]) for r in range(2)]
    denom = sum(run(p).denom for p in parts)
    total = sum(run(p, denom).loss_sum for p in parts)
    if full.denom > 0:
        torch.testing.assert_close(total / denom, full.loss)
