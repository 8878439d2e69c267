"""Gradients of the algo losses do not depend on the data-parallel layout (DP=1 vs DP=2, gloo).

One two-process gloo run (torch.multiprocessing spawn, free port on 127.0.0.1) computes the
DP=2 gradient for every mode; each parametrized test compares one mode with DP=1.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the worker by name
import algo_dp_worker
from spawn_testing import free_port

from moe_rl.algo.aggregate import AGGREGATIONS

MODES = [*AGGREGATIONS, "espo"]
WORLD = 2


@pytest.fixture(scope="module")
def dp2_grads(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("algo_dp")
    mp.spawn(
        algo_dp_worker.rank_main, args=(WORLD, free_port(), MODES, str(out_dir)), nprocs=WORLD, join=True
    )
    return out_dir


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_equal_at_dp1_and_dp2(dp2_grads, mode):
    expected = algo_dp_worker.reference_grad(mode)
    assert torch.count_nonzero(expected) > 0
    for rank in range(WORLD):
        got = torch.load(dp2_grads / f"{mode}.{rank}.pt")
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_shards_are_uneven_and_local_denominators_would_differ():
    problem = algo_dp_worker.make_problem()
    shards = [algo_dp_worker.shard(problem, r, WORLD) for r in range(WORLD)]
    assert sum(len(s["tokens"]) for s in shards) == len(problem["tokens"])
    assert len(shards[0]["tokens"]) != len(shards[1]["tokens"])
    weight = problem["weight"].clone().requires_grad_()
    grads = []
    for s in shards:
        out = algo_dp_worker.local_loss(s, weight, "token_mean")
        grads.append(torch.autograd.grad(out.loss_sum / out.denom, weight)[0])
    assert not torch.allclose(sum(grads) / WORLD, algo_dp_worker.reference_grad("token_mean"))
