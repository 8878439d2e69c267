"""Rank body for tests/distributed/test_trainer_dp.py: one gradient accumulation of the tiny MoE
on a share of a fixed global batch, gradients saved under global (HF) tensor names."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

GLOBAL_MICRO_BATCHES = 4


def recipe(world: int, ep: int, hf_path: str | None = None, pp: int = 1, *extra: str):
    from trainer_testing import tiny_recipe

    overrides = [f"model.hf_path={hf_path}"] if hf_path else []
    return tiny_recipe(
        f"parallel.trainer_world_size={world}",
        f"parallel.expert_model_parallel_size={ep}",
        f"parallel.pipeline_model_parallel_size={pp}",
        "trainer.grad_clip=0",
        *overrides,
        *extra,
    )


def write_weights(folder: str) -> None:
    """One set of weights for every layout (random init depends on how experts are split)."""
    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config

    config = recipe(1, 1)
    save_hf_checkpoint(build_gpt_model(config.model, seed=3), folder, model_config_to_hf_config(config.model))


def global_batch(config):
    from trainer_testing import micro_batches

    return micro_batches(21, 16, config.model, max_tokens=40, num_microbatches=GLOBAL_MICRO_BATCHES)


def shard(batches, rank: int, world: int, even: bool):
    """Uneven token counts per rank; with ``even`` the same number of micro-batches per rank
    (expert parallelism runs collectives inside every forward)."""
    if world == 1:
        return list(batches)
    return [batches[0], batches[3]] if rank == 0 and even else ([batches[0]] if rank == 0 else batches[1:])


def gradients(
    world: int, rank: int, ep: int, hf_path: str, kept: dict | None = None, gemm: str = "torch"
) -> dict[str, torch.Tensor]:
    """The gradients of this rank's share (``kept``, when given, receives the worker's ``model``),
    its experts multiplied as ``trainer.expert_gemm=gemm`` says."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.megatron.grouped_experts import GroupedExperts
    from moe_rl.megatron.hf_weights import hf_names_for
    from moe_rl.trainer.worker import TrainerWorker

    config = recipe(world, ep, hf_path, 1, f"trainer.expert_gemm={gemm}")
    worker = TrainerWorker(config)
    kinds = {type(m) for m in worker.model.modules() if isinstance(m, SequentialMLP)}
    assert kinds == {GroupedExperts if gemm == "torch" else SequentialMLP}, kinds
    batches = global_batch(config)
    if ep > 1:
        mine = [batches[0], batches[3]] if rank == 0 else [batches[1], batches[2]]
    else:
        mine = shard(batches, rank, world, even=False)
    mine, _ = worker.compute_old_logp(mine)
    worker.accumulate_gradients(mine)
    grads = {}
    for name, param in worker.model.named_parameters():
        key = "+".join(hf_names_for(worker.model, name).hf)
        grads[key] = param.main_grad.detach().clone()
    if kept is not None:
        kept["model"] = worker.model
    return grads


def sent_to_vllm(model) -> dict:
    """What this rank sends by vLLM's NCCL transfer (`moe_rl.weight_sync.vllm_transfer.TrainerSource`,
    as a trainer rank builds it): its metadata, then its tensors (every rank iterates together); and
    what it shares by vLLM's IPC transfer (every rank the whole model)."""
    from moe_rl.weight_sync.outgoing import sends
    from moe_rl.weight_sync.vllm_transfer import source

    weights = source(model, torch.bfloat16, "cpu", select=sends)
    meta = [(m.name, m.dtype, m.shape) for m in weights.metadata()]
    everywhere = source(model, torch.bfloat16, "cpu", every_rank=True)  # as for vLLM's IPC transfer
    return {
        "meta": meta, "sent": [(name, tensor.clone()) for name, tensor in weights],
        "shared": [(name, tensor.clone()) for name, tensor in everywhere],
    }  # fmt: skip


def sent_by_device_ipc(model, rank: int) -> dict:
    """What the engine that shares this rank's device receives from it by `DeviceIpc` (the whole
    model, every rank streaming at once): buckets pickled as Ray hands them, read through their
    handles. Twice: every rank with an engine, then only rank 0 (rank 1's device hosts none: it
    only joins the gathers)."""
    import pickle

    from moe_rl.config.modes import SyncRoute
    from moe_rl.config.schema import QuantConfig
    from moe_rl.config.sync_plan import SyncPlan
    from moe_rl.weight_sync.receiver import decoded
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import Receiver

    plan = SyncPlan(
        SyncRoute.DEVICE_IPC, False, "bf16", 16 << 10, "the device route (torch shares CPU buffers)"
    )
    sender = RankSender(model, QuantConfig(), num_layers=2, plan=plan, rank=rank)
    out: dict = {"both": [], "alone": []}
    try:
        for key in ("both", "alone"):
            got = out[key]

            def engine(bucket, got=got):
                got.extend((n, t.clone()) for n, t in decoded(pickle.loads(pickle.dumps(bucket))))

            receivers = {0: Receiver(engine)} if key == "both" or rank == 0 else {}
            report = sender.send(receivers, timeout_s=60.0)
            out[f"{key}_transports"] = sorted(report.transports)
    finally:
        sender.close()
    return out


def rank_main(rank: int, world: int, port: int, ep: int, hf_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    kept: dict = {}
    torch.save(gradients(world, rank, ep, hf_path, kept), Path(out_dir) / f"grads.{rank}.pt")
    sent = {**sent_to_vllm(kept["model"]), "ipc": sent_by_device_ipc(kept["model"], rank)}
    torch.save(sent, Path(out_dir) / f"sent.{rank}.pt")


def pipeline_outputs(pp: int, hf_path: str, *extra: str) -> dict[str, torch.Tensor]:
    """PP=``pp`` on ``pp`` ranks: the metrics of both passes (``__old__/``, ``__train__/``), the
    gradients and the updated weights after one optimizer step (``__param__/``), global names."""
    from moe_rl.megatron.hf_weights import hf_names_for
    from moe_rl.trainer.worker import TrainerWorker

    config = recipe(pp, 1, hf_path, pp, "trainer.grad_clip=1.0", *extra)  # clipping: a real grad norm
    worker = TrainerWorker(config)
    batches = global_batch(config)
    batches, old = worker.compute_old_logp(batches)
    step = worker.train_step(batches)
    step = {k: v for k, v in step.items() if k != "train/lr"}
    out = {"__old__/" + k: torch.tensor(v, dtype=torch.float64) for k, v in old.items()}
    out |= {"__train__/" + k: torch.tensor(v, dtype=torch.float64) for k, v in step.items()}
    for name, param in worker.model.named_parameters():
        key = "+".join(hf_names_for(worker.model, name).hf)
        out[key] = param.main_grad.detach().clone()
        out["__param__/" + key] = param.detach().clone()
    return out


def pipeline_rank_main(rank: int, world: int, port: int, hf_path: str, out_dir: str, extra: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from moe_rl.megatron.parallel import teardown_parallel

    torch.save(pipeline_outputs(world, hf_path, *extra), Path(out_dir) / f"pp.{rank}.pt")
    teardown_parallel()  # a clean exit: no gloo threads left to the interpreter's shutdown
