"""The trainer's gradient does not depend on the data-/expert-parallel layout (gloo, CPU).

DP=2: two ranks take uneven shares of one global batch (one micro-batch vs three); the summed
and globally normalized gradient equals the single-process gradient on the whole batch.
EP=2 (+ DP=2 for dense parameters): Megatron's allgather token dispatcher over gloo; each rank
holds half of the experts; every expert gradient equals the single-process one. The layouts run
the experts as grouped products (`trainer.expert_gemm=torch`), the reference as Megatron's
`SequentialMLP`.
In both layouts, what the trainer sends by vLLM's NCCL transfer (`weight_sync.vllm_transfer`, one
sender): rank 0 sends every weight of the model (the other rank's experts gathered to it), in
vLLM's bf16, as its metadata declares them; the other rank sends nothing. By vLLM's IPC transfer
(colocated) every rank holds the whole model, in the same order; by `DeviceIpc` (colocated
Megatron engines) every rank streams the whole model into its device buffers, and a rank whose
device hosts no engine only joins the gathers. On the routes where each rank sends what it owns
(`outgoing.owned`), the two ranks together send every weight once, each expert under its global index.
The same ranks then run PPO with a critic (`trainer_dp_worker.critic_outputs`): the critic's values,
the GAE returns and the advantages whitened over the whole batch (the ranks' sums all-reduced), the
critic's loss, gradient norm, gradients and weights after its step equal the one-process run's.
"""

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


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """HF folder with the starting weights of every layout."""
    return write_trainer_weights(str(tmp_path_factory.mktemp("weights")))


@pytest.fixture(scope="module")
def reference(weights):
    """DP=1 gradients on the whole global batch, in this process, through Megatron's own
    `SequentialMLP` (the layouts below run `GroupedExperts`, the CPU default)."""
    return trainer_dp_worker.gradients(world=1, rank=0, ep=1, hf_path=weights, gemm="sequential")


@pytest.fixture(scope="module")
def lora_reference(weights):
    """LoRA's adapter gradients at DP=1 on the whole global batch, in this process, through
    Megatron's own `SequentialMLP` (the ranks run `GroupedExperts`)."""
    return trainer_dp_worker.gradients(world=1, rank=0, ep=1, hf_path=weights, gemm="sequential", lora=True)


@pytest.fixture(scope="module")
def critic_reference(weights):
    """PPO with a critic at DP=1 on the whole global batch, in this process."""
    config = trainer_dp_worker.recipe(1, 1, weights, 1, *trainer_dp_worker.PPO)
    return trainer_dp_worker.critic_outputs(config, list(range(trainer_dp_worker.GLOBAL_MICRO_BATCHES)))


@pytest.fixture(scope="module")
def teacher(weights, tmp_path_factory) -> tuple[str, str]:
    """The distillation's teacher: its Hugging Face folder and the recipe of its architecture."""
    return trainer_dp_worker.write_teacher(str(tmp_path_factory.mktemp("teacher")))


@pytest.fixture(scope="module")
def distill_reference(weights, teacher):
    """On-policy distillation at DP=1 on the whole global batch, in this process."""
    config = trainer_dp_worker.distill_recipe(1, weights, teacher)
    return trainer_dp_worker.distill_outputs(config, list(range(trainer_dp_worker.GLOBAL_MICRO_BATCHES)))


EPS = (1, 2)


@pytest.fixture(scope="module")
def dp_runs(weights, teacher, tmp_path_factory) -> Path:
    """DP=2 with EP=1, then EP=2, both ranks in one spawn (one start-up for both)."""
    out = tmp_path_factory.mktemp("dp_runs")
    args = (2, free_port(), list(EPS), weights, str(out), teacher)
    mp.spawn(trainer_dp_worker.rank_main, args=args, nprocs=2, join=True)
    return out


@pytest.fixture
def spawn(dp_runs, weights, critic_reference):
    def run(ep: int) -> list[dict[str, torch.Tensor]]:
        sent = [torch.load(dp_runs / f"sent.{ep}.{rank}.pt") for rank in range(2)]
        _check_sent_to_vllm(sent, weights)
        _check_sent_by_owners([rank["owners"] for rank in sent], weights, ep)
        assert_critic_matches(
            [torch.load(dp_runs / f"critic.{ep}.{rank}.pt") for rank in range(2)], critic_reference
        )
        return [torch.load(dp_runs / f"grads.{ep}.{rank}.pt") for rank in range(2)]

    return run


def _check_sent_to_vllm(ranks: list[dict], weights: str) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(Path(weights) / "model.safetensors"))
    first, second = ranks
    names = [name for name, _ in first["sent"]]
    assert sorted(names) == sorted(hf) and len(set(names)) == len(names)
    assert first["meta"] == [(name, t.dtype, tuple(t.shape)) for name, t in first["sent"]]
    for name, tensor in first["sent"]:
        assert torch.equal(tensor, hf[name].to(torch.bfloat16)), name
    assert second["meta"] == second["sent"] == []
    for rank in ranks:  # vLLM's IPC transfer: each rank's GPU holds the whole model, experts gathered
        assert [name for name, _ in rank["shared"]] == names
        assert all(torch.equal(t, hf[name].to(torch.bfloat16)) for name, t in rank["shared"])
    # the Megatron engine on each rank's device gets the whole model from that rank, as it holds it
    for i, rank in enumerate(ranks):
        ipc = rank["ipc"]
        streams = [("both", True), ("alone", i == 0)]
        for key, receives in streams:
            got = dict(ipc[key])
            assert len(got) == len(ipc[key]), "a tensor arrived twice"
            assert sorted(got) == (sorted(hf) if receives else []), (i, key)
            assert all(torch.equal(t, hf[name].to(t.dtype)) for name, t in got.items())
            assert ipc[f"{key}_transports"] == (["device_ipc"] if receives else [])


def _check_sent_by_owners(ranks: list[dict], weights: str, ep: int) -> None:
    """Where each rank sends what it owns, the two ranks together send every weight once, as it
    is: at EP 1 rank 0 all of them (data-parallel rank 1 nothing); at EP 2 rank 0 the dense
    weights and its experts, rank 1 its own experts under their global indices."""
    from safetensors.torch import load_file

    hf = load_file(str(Path(weights) / "model.safetensors"))
    names = [[name for name, _ in rank["tensors"]] for rank in ranks]
    assert sorted(names[0] + names[1]) == sorted(hf)
    for rank in ranks:
        assert all(torch.equal(t, hf[name].to(t.dtype)) for name, t in rank["tensors"])
    dense = sorted(n for n in hf if ".mlp.experts." not in n)
    if ep == 1:
        assert names[1] == [] and ranks[1]["transports"] == []
    else:
        assert sorted(n for n in names[0] if ".mlp.experts." not in n) == dense
        assert names[1] and all(".mlp.experts." in n for n in names[1])
        assert ranks[1]["transports"] == ["in_process"]
    assert ranks[0]["transports"] == ["in_process"]


def _compare(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, grad in got.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_dp2_gradients_equal_dp1(spawn, reference):
    assert sum(float(g.abs().sum()) for g in reference.values()) > 0
    ranks = spawn(ep=1)
    for got in ranks:
        assert set(got) == set(reference)
        _compare(got, reference)


@pytest.mark.parametrize("ep", EPS)
def test_lora_adapter_gradients_equal_one_process(dp_runs, lora_reference, ep):
    """LoRA on every target (attention, every expert): at DP=2 (EP 1) and EP=2 the adapters'
    gradients equal the one-process run's, each expert's on the rank that holds it; the frozen base
    has no gradient buffer on any rank."""
    ranks = [torch.load(dp_runs / f"lora.{ep}.{rank}.pt") for rank in range(2)]
    assert all(k.endswith((".lora_a", ".lora_b")) for k in lora_reference) and lora_reference
    assert any(".mlp.experts." in k for k in lora_reference)
    held = set()
    for got in ranks:
        _compare(got, lora_reference)
        held |= set(got)
    assert held == set(lora_reference)
    if ep > 1:
        experts = [{k for k in got if ".mlp.experts." in k} for got in ranks]
        assert experts[0] and not experts[0] & experts[1]


def test_ep2_gradients_equal_ep1(spawn, reference):
    ranks = spawn(ep=2)
    experts = [{k for k in got if ".mlp.experts." in k} for got in ranks]
    assert experts[0] and not experts[0] & experts[1]  # each rank holds its own experts
    assert experts[0] | experts[1] == {k for k in reference if ".mlp.experts." in k}
    for got in ranks:
        _compare(got, reference)


def test_distillation_at_dp2_takes_the_whole_batchs_mean_gap_as_its_baseline(dp_runs, distill_reference):
    """Rank 0 holds micro-batch 0, rank 1 the other three: each rank's own mean teacher − π_old gap
    differs from the batch's, yet both report the batch's ``distill/reverse_kl`` and every
    micro-batch's advantages equal the one-process run's (the baseline summed over the ranks)."""
    ranks = [torch.load(dp_runs / f"distill.{rank}.pt") for rank in range(2)]
    batch_kl = distill_reference["__old__/distill/reverse_kl"]
    local = []
    for got in ranks:
        torch.testing.assert_close(got["__old__/distill/reverse_kl"], batch_kl, rtol=1e-5, atol=1e-7)
        gaps = [
            got[k] - got[k.replace("teacher_logp", "old_logp")] for k in got if k.endswith("teacher_logp")
        ]
        local.append(float(torch.cat(gaps).double().mean()))
        for key, value in got.items():
            if key.startswith("__mb"):
                torch.testing.assert_close(value, distill_reference[key], rtol=1e-5, atol=1e-6, msg=key)
    assert abs(local[0] - local[1]) > 1e-3 and abs(local[0] + float(batch_kl)) > 1e-4
    found = {k for got in ranks for k in got if k.startswith("__mb")}
    assert found == {k for k in distill_reference if k.startswith("__mb")}


def test_with_context_parallelism_one_rank_of_the_group_sends(dp_runs):
    """The two ranks one context-parallel group (CP=2, DP=1): they hold the same weights, and only the
    first sends them (the rule counts data- and context-parallel ranks together)."""
    got = [torch.load(dp_runs / f"sends_cp2.{rank}.pt") for rank in range(2)]
    names = trainer_dp_worker.SENT_NAMES
    assert got == [dict.fromkeys(names, True), dict.fromkeys(names, False)]
