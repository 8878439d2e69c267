"""Tensor parallelism (gloo, CPU): HF weights load into TP-sharded Megatron models, whose logits
equal the one-process model's, and export back to HF names exactly (shards gathered).

The same ranks run the π_old pass of PPO with a critic (Qwen3-MoE, the trainer's tiny recipe): the
critic's values, the GAE returns and the advantages whitened over the batch equal the one-process
run's. Under sequence parallelism the critic's `ValueHead` gathers the sequence: on each rank's
share its values are every position's, its gradients the rank's share of the one-process ones.

Only the forward runs here: Megatron's MoE layer refuses TP > 1 in training mode without sequence
parallelism, and sequence parallelism needs the transformer-engine or apex norms (GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the worker by name
import tp_worker
from spawn_testing import assert_critic_matches, free_port

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed


FAMILIES = ("qwen3_moe", "deepseek_v3")
ETPS = (1, 2)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple]:
    """Each family's HF folder, its one-process logits and (Qwen3-MoE) critic pass."""
    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.parallel import init_parallel

    init_parallel(ParallelConfig())
    found = {}
    for family in FAMILIES:
        folder = str(tmp_path_factory.mktemp(f"hf_{family}"))
        logits = tp_worker.write_reference(family, folder)
        critic = tp_worker.critic_old_pass(1, 1, folder) if family == "qwen3_moe" else None
        found[family] = (folder, logits, critic)
    return found


@pytest.fixture(scope="module")
def tp_runs(references, tmp_path_factory) -> Path:
    """Every family and expert-TP size on TP=2, both ranks in one spawn (one start-up for all)."""
    out = tmp_path_factory.mktemp("tp_runs")
    jobs = [(family, etp, references[family][0]) for family in FAMILIES for etp in ETPS]
    mp.spawn(tp_worker.rank_main, args=(2, free_port(), jobs, str(out)), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("etp", ETPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_loads_computes_and_exports_like_one_process(references, tp_runs, family, etp):
    folder, logits, critic = references[family]
    hf = load_file(str(Path(folder) / "model.safetensors"))
    ranks = [torch.load(tp_runs / f"tp.{family}.{etp}.{rank}.pt") for rank in range(2)]
    for got in ranks:
        # the ranks really hold shards: attention and output layer split, experts split iff ETP=2
        shapes = got["shapes"]
        assert shapes["output_layer.weight"][0] == 32  # vocab 64 over 2 ranks
        expert_fc1 = next(v for k, v in shapes.items() if "local_experts.0.linear_fc1" in k)
        assert expert_fc1[0] == 2 * 16 // etp
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
        assert set(got["weights"]) == set(hf)
        for name, tensor in got["weights"].items():
            assert torch.equal(tensor, hf[name]), name
    exported = load_file(str(tp_runs / f"export.{family}.{etp}" / "model.safetensors"))
    assert set(exported) == set(hf) and all(torch.equal(exported[n], hf[n]) for n in hf)
    if critic is not None:
        assert_critic_matches([got["critic"] for got in ranks], critic)
    whole = tp_worker.value_head(0, 1, sequence_parallel=False)
    for rank, got in enumerate(ranks):
        head = got["value_head"]
        torch.testing.assert_close(head["values"], whole["values"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(
            head["hidden_grad"], whole["hidden_grad"].chunk(2)[rank], rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(head["head_grad"], whole["head_grad"], rtol=1e-5, atol=1e-7)
    if "lora" in ranks[0]:
        _check_lora_linears([got["lora"] for got in ranks])
        _check_lora_linears_sequence_parallel([got["lora_sp"] for got in ranks])


def _check_lora_linears(ranks: list[dict[str, torch.Tensor]]) -> None:
    """LoRA on Megatron's column- and row-parallel linears at TP=2 against one process: outputs and
    the gradients of the input, the weight and the adapters, each rank its shard of them."""
    whole = tp_worker.lora_linears(0, 1)
    for rank, got in enumerate(ranks):
        assert got.pop("column.summed").tolist() == got.pop("row.summed").tolist() == [False, False]
        expected = {
            # column: output and B split by output rows; A and the input (summed over ranks) whole
            "column.out": whole["column.out"].chunk(2, dim=-1)[rank],
            "column.x_grad": whole["column.x_grad"],
            "column.weight_grad": whole["column.weight_grad"].chunk(2, dim=0)[rank],
            "column.a_grad": whole["column.a_grad"],
            "column.b_grad": whole["column.b_grad"].chunk(2, dim=0)[rank],
            # row: the input, the weight and A split by input columns; the output (reduced) and B whole
            "row.out": whole["row.out"],
            "row.x_grad": whole["row.x_grad"].chunk(2, dim=-1)[rank],
            "row.weight_grad": whole["row.weight_grad"].chunk(2, dim=1)[rank],
            "row.a_grad": whole["row.a_grad"].chunk(2, dim=1)[rank],
            "row.b_grad": whole["row.b_grad"],
        }
        assert set(got) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")


def _check_lora_linears_sequence_parallel(ranks: list[dict[str, torch.Tensor]]) -> None:
    """The same linears with sequence parallelism: the column linear's input and the row linear's
    output split by sequence (rows 0-2, 3-5), the rest as without it; the column linear's ``A`` and
    the row linear's ``B`` gradients are each rank's part, marked for Megatron's finalize to sum:
    their sum over the ranks is the one-process gradient."""
    whole = tp_worker.lora_linears(0, 1)
    for rank, got in enumerate(ranks):
        assert got["column.summed"].tolist() == [True, False] and got["row.summed"].tolist() == [False, True]
        expected = {
            "column.out": whole["column.out"].chunk(2, dim=-1)[rank],
            "column.x_grad": whole["column.x_grad"].chunk(2, dim=0)[rank],
            "column.weight_grad": whole["column.weight_grad"].chunk(2, dim=0)[rank],
            "column.b_grad": whole["column.b_grad"].chunk(2, dim=0)[rank],
            "row.out": whole["row.out"].chunk(2, dim=0)[rank],
            "row.x_grad": whole["row.x_grad"].chunk(2, dim=-1)[rank],
            "row.weight_grad": whole["row.weight_grad"].chunk(2, dim=1)[rank],
            "row.a_grad": whole["row.a_grad"].chunk(2, dim=1)[rank],
        }
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
    for name in ("column.a_grad", "row.b_grad"):  # the parts Megatron's finalize_model_grads sums
        torch.testing.assert_close(
            sum(got[name] for got in ranks), whole[name], rtol=1e-5, atol=1e-5, msg=name
        )
