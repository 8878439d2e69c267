"""Pipeline parallelism (gloo, CPU): Megatron's 1F1B schedule over two stages gives the gradients,
metrics (on every rank), gradient norm and updated weights of the one-process trainer, with R3 replay (each stage replays its own layers'
columns of the full-model trace), with R2 (each stage records and replays its own layers), and
with activation recompute (REPLAY_BACKWARD pops each stage's ids in forward order), and with a KL
penalty (the reference's forward-only pass through the schedule, R3 or R2 routing). With R3, the
same ranks then run PPO with a critic over the two stages: its values, the GAE returns and whitened
advantages (last stage), its loss and gradient norm (every rank), its gradients and its weights after
its step (each stage its own) equal the one-process run's. A rank of one of the stages refuses to send
the whole model (`outgoing.whole_model`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the worker by name
import trainer_dp_worker
from spawn_testing import assert_critic_matches, free_port, write_trainer_weights

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

CASES = {
    "r3": (),
    # random rollout log-probs are far from full-vocabulary ones: IcePop and OPSM would mask all
    "r2": (
        "algo.routing_replay=r2",
        "algo.corrections.keep_sampling_mask=false",
        "algo.corrections.icepop.enabled=false",
        "algo.corrections.opsm.enabled=false",
    ),
    "r3_recompute": ("trainer.recompute_activations=true",),
    # the reference's pass through the schedule; k1's gradient is not 0 where π_θ = π_ref
    "r3_kl": ("algo.kl.coef=0.5", "algo.kl.estimator=k1"),
    "r2_kl": (
        "algo.routing_replay=r2",
        "algo.corrections.keep_sampling_mask=false",
        "algo.corrections.icepop.enabled=false",
        "algo.corrections.opsm.enabled=false",
        "algo.kl.coef=0.5",
        "algo.kl.estimator=k1",
    ),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """HF folder with the starting weights of every layout."""
    return write_trainer_weights(str(tmp_path_factory.mktemp("weights_pp")))


CRITIC = "r3"
"""The case whose ranks also run PPO with a critic (each case would cost a critic's build and step)."""


@pytest.fixture(scope="module")
def pp_runs(weights, tmp_path_factory) -> Path:
    """Every case on PP=2, both ranks in one spawn (one start-up for all): `pp.<case>.<rank>.pt`."""
    out = tmp_path_factory.mktemp("pp_runs")
    mp.spawn(
        trainer_dp_worker.pipeline_rank_main,
        args=(2, free_port(), weights, str(out), CASES, CRITIC),
        nprocs=2,
        join=True,
    )
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_matches_pp1(case, weights, pp_runs):
    extra = CASES[case]
    reference = trainer_dp_worker.pipeline_outputs(1, weights, *extra)
    r3 = not case.startswith("r2")
    assert not r3 or reference["__old__/old/routing_agreement"] < 1  # R3 traces are not natural
    critic = case == CRITIC
    ranks = [torch.load(pp_runs / f"pp.{case}.{rank}.pt") for rank in range(2)]
    grads = [{k for k in got if not k.startswith("__")} for got in ranks]
    assert reference["__train__/train/grad_norm"] > 0 and reference["__train__/train/update_ok"] == 1
    assert grads[0] and grads[1] and not grads[0] & grads[1]  # each stage holds its own layers
    assert grads[0] | grads[1] == {k for k in reference if not k.startswith("__")}
    assert any("layers.0." in k for k in grads[0]) and any("layers.1." in k for k in grads[1])
    for got in ranks:
        own = {k for k in got if k.startswith("__old__/") or k.startswith("__train__/")}
        assert own == {k for k in reference if k.startswith("__old__/") or k.startswith("__train__/")}
        for name, value in got.items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-7, msg=name)
    if critic:
        config = trainer_dp_worker.recipe(1, 1, weights, 1, *extra, *trainer_dp_worker.PPO)
        everything = list(range(trainer_dp_worker.GLOBAL_MICRO_BATCHES))
        expected = trainer_dp_worker.critic_outputs(config, everything)
        critics = [torch.load(pp_runs / f"critic.{rank}.pt") for rank in range(2)]
        assert not any(k.startswith("__mb") for k in critics[0])  # the values live on the last stage
        assert_critic_matches(critics, expected)


def test_a_rank_of_one_stage_refuses_to_send_the_whole_model(pp_runs):
    """The routes on which a rank sends the whole model need it to hold every layer."""
    for rank in range(2):
        refused = torch.load(pp_runs / f"whole_model.{rank}.pt")
        assert refused == "sending the whole model from a rank needs one pipeline stage"
