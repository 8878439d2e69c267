"""Rank body for tests/distributed/test_trainer_tp.py: load HF weights into a TP-sharded tiny MoE,
compute logits, and export the weights back to HF names."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

SEQUENCES = [[1, 5, 9, 13, 2, 7], [3, 4, 11, 60, 8], [0, 63, 17, 33, 41, 42, 12]]


def model_config(family: str):
    from trainer_testing import tiny_deepseek, tiny_qwen

    return tiny_qwen() if family == "qwen3_moe" else tiny_deepseek()


def logits_of(model) -> torch.Tensor:
    from moe_rl.megatron.decoding import pack_sequences
    from moe_rl.megatron.forward import forward_logits

    model.eval()
    with torch.no_grad():
        return forward_logits(model, pack_sequences(SEQUENCES, next(model.parameters()).device))


def write_reference(family: str, folder: str) -> torch.Tensor:
    """One-process model (seed 3): its HF folder and its logits."""
    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config

    config = model_config(family)
    model = build_gpt_model(config, seed=3)
    save_hf_checkpoint(model, folder, model_config_to_hf_config(config))
    return logits_of(model)


def rank_main(rank: int, world: int, port: int, family: str, etp: int, hf_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.hf_weights import iter_hf_weights, load_hf_checkpoint, save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel

    parallel = ParallelConfig(
        trainer_world_size=world, tensor_model_parallel_size=world, expert_tensor_parallel_size=etp
    )
    init_parallel(parallel)
    config = model_config(family)
    model = build_gpt_model(config, parallel, seed=11)  # different init: everything must come from the load
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    load_hf_checkpoint(model, hf_path)
    exported = dict(iter_hf_weights(model))
    save_hf_checkpoint(model, Path(out_dir) / "export", model_config_to_hf_config(config))
    torch.save(
        {"logits": logits_of(model), "weights": exported, "shapes": shapes}, Path(out_dir) / f"tp.{rank}.pt"
    )
