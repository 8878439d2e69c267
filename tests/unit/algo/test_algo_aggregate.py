"""moe_rl.algo.aggregate: the four aggregation modes as (sum, denominator)."""

import pytest
import torch

from moe_rl.algo.aggregate import AGGREGATIONS, aggregate, local_denominator, seq_mean_token_sum_norm
from tests.unit.algo.algo_testing import seq_ids_for, t

# responses: [1, 2 | 3, 4, (99 masked)] and a fully masked third response
LOSS = t([1.0, 2.0, 3.0, 4.0, 99.0, 7.0])
MASK = torch.tensor([True, True, True, True, False, False])
SEQ = seq_ids_for([2, 3, 1])


@pytest.mark.parametrize(
    ("mode", "loss_sum", "denom"),
    [
        ("token_mean", 10.0, 4.0),
        ("seq_mean_token_sum", 10.0, 2.0),  # the fully masked response is not counted
        ("seq_mean_token_mean", 1.5 + 3.5, 2.0),
        ("seq_mean_token_sum_norm", 10.0 / 4, 2.0),  # norm_len = 4
    ],
    ids=list(AGGREGATIONS),
)
def test_aggregate_hand_values(mode, loss_sum, denom):
    got_sum, got_denom = aggregate(LOSS, MASK, SEQ, num_seqs=3, mode=mode, norm_len=4)
    assert got_sum.item() == pytest.approx(loss_sum)
    assert got_denom.item() == pytest.approx(denom)
    assert local_denominator(MASK, SEQ, num_seqs=3, mode=mode).item() == pytest.approx(denom)


def test_global_denominator_replaces_the_local_count():
    s, d = aggregate(LOSS, MASK, SEQ, num_seqs=3, mode="token_mean", global_denom=torch.tensor(40.0))
    assert (s / d).item() == pytest.approx(0.25)
    s, d = aggregate(LOSS, MASK, SEQ, num_seqs=3, mode="seq_mean_token_sum", global_denom=5)
    assert d.item() == 5


def test_seq_num_tokens_gives_the_global_response_length():
    s, _ = aggregate(
        LOSS, MASK, SEQ, num_seqs=3, mode="seq_mean_token_mean", seq_num_tokens=t([4.0, 2.0, 1.0])
    )
    assert s.item() == pytest.approx(3.0 / 4 + 7.0 / 2)


def test_masked_nan_does_not_leak():
    loss = LOSS.clone()
    loss[4] = float("nan")
    s, _ = aggregate(loss, MASK, SEQ, num_seqs=3, mode="seq_mean_token_mean")
    assert torch.isfinite(s)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "sum"}, "aggregation must be one of"),
        ({"mode": "seq_mean_token_sum_norm"}, "norm_len must be > 0"),
        ({"mode": "token_mean", "global_denom": 0}, "global_denom must be a positive"),
    ],
    ids=["mode", "norm-len", "global-denom"],
)
def test_aggregate_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aggregate(LOSS, MASK, SEQ, num_seqs=3, **kwargs)


def test_named_wrapper():
    s, d = seq_mean_token_sum_norm(LOSS, MASK, SEQ, num_seqs=3, norm_len=2)
    assert (s.item(), d.item()) == (5.0, 2.0)
