"""Rank body for tests/distributed/test_trainer_tp.py: load HF weights into a TP-sharded tiny MoE,
compute logits, and export the weights back to HF names; the π_old pass of PPO with a critic on the
trainer's tiny recipe (TP-sharded, the same weights); a `ValueHead` under sequence parallelism."""

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


def critic_recipe(world: int, etp: int, hf_path: str):
    """The tiny recipe's PPO with a critic (`trainer_dp_worker.PPO`) at TP=``world``, ETP=``etp``,
    from the Qwen3-MoE weights in ``hf_path``."""
    import trainer_dp_worker

    tp = (f"parallel.tensor_model_parallel_size={world}", f"parallel.expert_tensor_parallel_size={etp}")
    return trainer_dp_worker.recipe(world, 1, hf_path, 1, *tp, *trainer_dp_worker.PPO)


def critic_old_pass(world: int, etp: int, hf_path: str) -> dict[str, torch.Tensor]:
    """`trainer_dp_worker.critic_outputs` of the π_old pass on the whole global batch (no step:
    Megatron's MoE layer trains at TP > 1 only with sequence parallelism, GPU norms)."""
    import trainer_dp_worker

    everything = list(range(trainer_dp_worker.GLOBAL_MICRO_BATCHES))
    return trainer_dp_worker.critic_outputs(critic_recipe(world, etp, hf_path), everything, train=False)


HEAD_SHAPE = (8, 2, 32)
"""Hidden states [s, b, h] of the `ValueHead` check."""


def value_head(rank: int, world: int, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """A `ValueHead` on fixed hidden states (with ``sequence_parallel``, this rank's share of their
    sequence) and a fixed linear loss of its values: the values, the gradients of the hidden states
    (this rank's share) and of the head."""
    from moe_rl.trainer.critic import ValueHead

    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(HEAD_SHAPE, generator=generator)
    scale = torch.randn(*HEAD_SHAPE[:2], 1, generator=generator)
    head = ValueHead(HEAD_SHAPE[-1], torch.float32, torch.device("cpu"), sequence_parallel)
    with torch.no_grad():
        head.weight.normal_(generator=generator)
    mine = (hidden.chunk(world)[rank] if sequence_parallel else hidden).clone().requires_grad_()
    values, bias = head(mine)
    assert bias is None
    (values * scale).sum().backward()
    return {"values": values.detach(), "hidden_grad": mine.grad, "head_grad": head.weight.grad}


def rank_main(rank: int, world: int, port: int, jobs: list[tuple[str, int, str]], out_dir: str) -> None:
    """Each job ``(family, etp, hf_path)`` on TP=``world`` in turn, in one process (Megatron's groups
    made again for each layout): `tp.<family>.<etp>.<rank>.pt` and the export `export.<family>.<etp>/`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from megatron.core import parallel_state as ps

    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.hf_weights import iter_hf_weights, load_hf_checkpoint, save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel

    for family, etp, hf_path in jobs:
        parallel = ParallelConfig(
            trainer_world_size=world, tensor_model_parallel_size=world, expert_tensor_parallel_size=etp
        )
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_parallel(parallel)
        config = model_config(family)
        model = build_gpt_model(
            config, parallel, seed=11
        )  # different init: everything must come from the load
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        load_hf_checkpoint(model, hf_path)
        exported = dict(iter_hf_weights(model))
        save_hf_checkpoint(model, Path(out_dir) / f"export.{family}.{etp}", model_config_to_hf_config(config))
        out = {"logits": logits_of(model), "weights": exported, "shapes": shapes}
        out["value_head"] = value_head(rank, world, sequence_parallel=True)
        if (family, etp) == ("qwen3_moe", 1):  # no model in it: once
            out["lora"] = lora_linears(rank, world)
            out["lora_sp"] = lora_linears(rank, world, sequence_parallel=True)
        if family == "qwen3_moe":  # the trainer's tiny recipe
            out["critic"] = critic_old_pass(world, etp, hf_path)
        torch.save(out, Path(out_dir) / f"tp.{family}.{etp}.{rank}.pt")


LORA_SHAPE = (6, 2, 16, 12, 4)
"""[s, b, in, out, rank] of the LoRA linears' check."""


def lora_linears(rank: int, world: int, sequence_parallel: bool = False) -> dict[str, torch.Tensor]:
    """Megatron's column- and row-parallel linears with LoRA adapters (`moe_rl.megatron.lora`) on
    fixed weights, adapters and input split as TP=``world`` splits them (with ``sequence_parallel``,
    the activations between them split by sequence too), and a fixed linear loss of their outputs:
    each output (this rank's part) and the gradients of the input, the weight, ``A`` and ``B`` (this
    rank's shards; a gradient Megatron's `finalize_model_grads` sums over the ranks, a parameter
    marked ``sequence_parallel``, as this rank's part, with the mark)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from moe_rl.config.schema import LoraConfig
    from moe_rl.megatron.lora import lora_classes

    s, b, fan_in, fan_out, r = LORA_SHAPE
    classes = lora_classes(LoraConfig(rank=r, alpha=8.0))
    config = ModelParallelConfig(
        tensor_model_parallel_size=world, use_cpu_initialization=True, sequence_parallel=sequence_parallel
    )
    found: dict[str, torch.Tensor] = {}
    for kind, base in (("column", ColumnParallelLinear), ("row", RowParallelLinear)):
        generator = torch.Generator().manual_seed(5)
        weight, a = (
            torch.randn(fan_out, fan_in, generator=generator),
            torch.randn(r, fan_in, generator=generator),
        )
        bmat = torch.randn(fan_out, r, generator=generator)
        x, g = torch.randn(s, b, fan_in, generator=generator), torch.randn(s, b, fan_out, generator=generator)
        extra = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
        linear = classes[base](
            fan_in,
            fan_out,
            config=config,
            init_method=lambda t: None,
            bias=False,
            skip_bias_add=True,
            **extra,
        )
        split = 0 if kind == "column" else 1
        with torch.no_grad():
            linear.weight.copy_(weight.chunk(world, dim=split)[rank])
            linear.lora_a.copy_(a if kind == "column" else a.chunk(world, dim=1)[rank])
            linear.lora_b.copy_(bmat.chunk(world, dim=0)[rank] if kind == "column" else bmat)
        # column: the input whole (split by sequence with SP); row: split by columns (whole sequence)
        if kind == "column":
            mine = x.chunk(world, dim=0)[rank] if sequence_parallel else x
            gain = g.chunk(world, dim=-1)[rank]
        else:
            mine = x.chunk(world, dim=-1)[rank]
            gain = g.chunk(world, dim=0)[rank] if sequence_parallel else g
        mine = mine.clone().requires_grad_()
        out, _ = linear(mine)
        (out * gain).sum().backward()
        found |= {
            f"{kind}.out": out.detach(), f"{kind}.x_grad": mine.grad, f"{kind}.weight_grad": linear.weight.grad,
            f"{kind}.a_grad": linear.lora_a.grad, f"{kind}.b_grad": linear.lora_b.grad,
            f"{kind}.summed": torch.tensor(
                [getattr(linear.lora_a, "sequence_parallel", False), getattr(linear.lora_b, "sequence_parallel", False)]
            ),
        }  # fmt: skip
    return found
