"""Tiny model configs, recipes and micro-batches shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.config.modes import ReplayMode
from moe_rl.config.schema import ModelConfig, RecipeConfig
from moe_rl.data.synthetic import random_batch
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.orchestration.preflight import load_checked
from moe_rl.trainer.batch import TrainMicroBatch, make_train_micro_batches
from moe_rl.trainer.logprobs import PassOptions

REPO = Path(__file__).resolve().parents[3]
TINY_RECIPE = REPO / "recipes" / "tiny_moe.yaml"


def tiny_qwen(**changes) -> ModelConfig:
    """Qwen3-MoE style: hidden 32, 2 layers, GQA 4/2 heads, 4 experts top-2, vocab 64."""
    base = {
        "family": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 16,
        "num_experts": 4,
        "moe_router_topk": 2,
        "max_position_embeddings": 64,
    }
    return ModelConfig(**{**base, **changes})


def tiny_deepseek(**changes) -> ModelConfig:
    """DeepSeek-V3 style: MLA, 1 dense + 2 MoE layers, 8 experts in 4 groups, top-4, shared expert."""
    base = {
        "family": "deepseek_v3",
        "attention": "mla",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 16,
        "num_experts": 8,
        "moe_router_topk": 4,
        "first_k_dense_layers": 1,
        "num_shared_experts": 1,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": 4,
        "moe_router_group_topk": 2,
        "moe_router_topk_scaling_factor": 2.5,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "max_position_embeddings": 64,
    }
    return ModelConfig(**{**base, **changes})


# The published DeepSeek-V3 config.json, less its rope scaling.
DEEPSEEK_V3_HF = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
}  # fmt: skip


TINY_MODEL_OVERRIDES = [
    "model.vocab_size=64",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.head_dim=8",
    "model.ffn_hidden_size=64",
    "model.moe_ffn_hidden_size=16",
    "model.num_experts=4",
]


def tiny_recipe(*overrides: str) -> RecipeConfig:
    """The tiny recipe (stability stack: R3, KSM, IcePop, OPSM, ESPO) on an even smaller model."""
    return load_checked(TINY_RECIPE, [*TINY_MODEL_OVERRIDES, *overrides])


def one_response(model: ModelConfig, tokens: int) -> list[TrainMicroBatch]:
    """A batch of one response of exactly ``tokens`` tokens (the first seed of `micro_batches` that
    draws one): the boundary cases of a batch's statistics."""
    for seed in range(1000):
        mbs = micro_batches(seed, 1, model)
        if sum(mb.micro.response_positions.numel() for mb in mbs) == tokens:
            return mbs
    raise AssertionError(f"no seed below 1000 draws one response of {tokens} tokens")


def micro_batches(
    seed: int,
    num_samples: int,
    model: ModelConfig,
    max_tokens: int = 48,
    routing: bool = True,
    sampling_mask: bool = True,
    num_microbatches: int | None = None,
    device: torch.device | str | None = None,
) -> list[TrainMicroBatch]:
    """Random valid trajectories for ``model`` (routing traces over its MoE layers), packed; on
    ``device`` when given (as a worker's boundary would put them), else on the CPU."""
    num_moe = model.num_layers - model.first_k_dense_layers
    trace = (num_moe, model.moe_router_topk, model.num_experts) if routing else None
    batch = random_batch(
        seed,
        num_samples,
        max_prompt_len=6,
        max_response_len=6,
        vocab_size=model.vocab_size,
        routing=trace,
        sampling_mask=sampling_mask,
    )
    advantages = torch.randn(num_samples, generator=torch.Generator().manual_seed(seed))
    packed = make_train_micro_batches(batch, advantages, max_tokens, num_microbatches)
    return packed if device is None else [mb.to(device) for mb in packed]


def assert_same(
    actual: torch.Tensor, expected: torch.Tensor, device: torch.device, tol: float = 1e-5
) -> None:
    """Bit-equal on the CPU; within ``tol`` on CUDA, where MoE token scatter uses float atomics
    whose order (and so the last bits) changes from run to run."""
    if device.type == "cpu":
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def run_old_pass(
    model: torch.nn.Module,
    micro: list[TrainMicroBatch],
    options: PassOptions,
    mode: ReplayMode = ReplayMode.OFF,
    replay: RoutingReplay | None = None,
    pad_to: int | None = None,
    diagnostics: bool = False,
) -> tuple[list[TrainMicroBatch], list[dict]]:
    """The trainer's π_old pass (`moe_rl.trainer.passes.old_pass`, the one `TrainerWorker` runs) over
    ``micro`` on ``model`` alone: routing ``mode`` through ``replay`` (R3 replays each micro-batch's
    ``routed_experts``, R2 records), every micro-batch padded to ``pad_to`` tokens when given."""
    from moe_rl.trainer import passes

    ctx = passes.PassContext(
        replay=replay,
        routing_replay=mode,
        options=options,
        diagnostics=diagnostics,
        pipelined=False,
        pad_length=lambda mb: pad_to,
    )
    return passes.old_pass(ctx, model, micro, 0, options.entropy, passes.shape_zero_variance(0.0))
