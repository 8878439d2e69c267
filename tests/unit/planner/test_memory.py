"""The planner's memory model (`moe_rl.planner.memory`) against hand counts: what one engine copy of
the weights weighs under each rollout recipe (the first and last layers it keeps in bf16 included),
its routed experts' share, the KV cache per token, and what a colocated GPU holds in each phase."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config.modes import Attention, Granularity, QuantMethod
from moe_rl.config.schema import ModelConfig, QuantConfig, RecipeConfig
from moe_rl.orchestration.preflight import load_checked
from moe_rl.planner.flops import ParamCounts
from moe_rl.planner.memory import (
    RolloutMemory,
    TrainerMemory,
    colocated_memory,
    kv_bytes_per_token,
    quant_bytes_per_weight,
    rollout_expert_bytes,
    rollout_memory,
    rollout_weight_bytes,
)

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
GIB = 1024**3

# A hand-sized MoE: 3 layers (the first dense), 4 experts of 30 weights, routers of 8.
COUNTS = ParamCounts(
    embedding=100, lm_head=100, final_norm=10, attention_per_layer=40, norms_per_layer=20,
    dense_mlp_per_layer=60, expert=30, shared_experts_per_layer=0, router_per_layer=8, num_layers=3,
    num_dense_layers=1, num_experts=4, topk=2,
)  # fmt: skip
# total 706: embedding 100, attention 3 x 40, dense MLP 60, experts 2 x 4 x 30, routers 2 x 8,
# norms 3 x 20 + 10, LM head 100. Kept in bf16 whatever the recipe: embedding, head, norms, routers
# (100 + 100 + 10 + 60 + 16 = 286); the other 420 are quantized.


def _quant(method: str, granularity: str = "tensor", first: int = 0, last: int = 0) -> QuantConfig:
    return QuantConfig(
        name=method, method=QuantMethod(method), granularity=Granularity(granularity),
        exclude_first_layers=first, exclude_last_layers=last,
    )  # fmt: skip


def _config(quant: QuantConfig) -> RecipeConfig:
    config = RecipeConfig()
    config.quant = quant
    return config


@pytest.mark.parametrize(
    ("method", "granularity", "nbytes"),
    [("fp8", "block", 1 + 4 / 128**2), ("fp8", "tensor", 1.0), ("int8", "channel", 1.0),
     ("int4_awq", "block", 0.5 + 2 / 128), ("nvfp4", "block", 0.5 + 1 / 16), ("none", "tensor", 2.0)],
)  # fmt: skip
def test_bytes_per_quantized_weight_count_the_scales(method, granularity, nbytes):
    assert quant_bytes_per_weight(_quant(method, granularity)) == nbytes


@pytest.mark.parametrize(
    ("first", "last", "nbytes", "experts"),
    [
        (0, 0, 286 * 2 + 420, 240),
        (1, 0, 386 * 2 + 320, 240),  # layer 0's attention and MLP in bf16 (its norms were already)
        (0, 1, 446 * 2 + 260, 120 * 2 + 120),  # layer 2's attention and experts (its router was)
        (1, 1, 546 * 2 + 160, 360),
        (1, 2, 706 * 2, 480),  # every layer excluded: the whole model in bf16
    ],
)
def test_one_engine_copy_weighs_its_quantized_and_its_bf16_parts(first, last, nbytes, experts):
    config = _config(_quant("fp8", first=first, last=last))  # one byte a quantized weight
    assert COUNTS.total == 706
    assert rollout_weight_bytes(config, COUNTS) == nbytes
    assert rollout_expert_bytes(config, COUNTS) == experts  # 2 MoE layers of 4 x 30, 2 bytes when kept


def test_the_kv_cache_per_token_splits_gqa_heads_over_tp_and_keeps_mlas_latent_on_each_rank():
    gqa = ModelConfig(num_layers=2, num_key_value_heads=4, head_dim=8)
    assert [kv_bytes_per_token(gqa, tp) for tp in (1, 2, 8)] == [
        2 * 2 * 4 * 8 * 2,
        2 * 2 * 2 * 8 * 2,
        2 * 2 * 8 * 2,
    ]
    mla = ModelConfig(num_layers=2, attention=Attention.MLA, kv_lora_rank=16, qk_rope_head_dim=4)
    assert kv_bytes_per_token(mla, 1) == kv_bytes_per_token(mla, 4) == 2 * (16 + 4) * 2


def test_an_engine_gpu_holds_its_share_of_the_weights_and_the_kv_cache_left_over():
    config = _config(_quant("fp8"))
    config.cluster.gpu_memory_gib, config.rollout.gpu_memory_utilization = 1.0, 0.5
    config.rollout.tensor_parallel_size = 2
    memory = rollout_memory(config, COUNTS)
    assert memory.budget_per_gpu == GIB / 2 and memory.weights_per_gpu == (286 * 2 + 420) / 2
    assert memory.kv_per_token == kv_bytes_per_token(config.model, 2)
    assert memory.kv_tokens == int((GIB / 2 - 496) // memory.kv_per_token)
    assert RolloutMemory(10.0, 5.0, 1.0).kv_tokens == 0  # weights beyond the budget leave no cache
    with pytest.raises(AttributeError):
        memory.kv_per_token = 0.0  # a value


@pytest.mark.parametrize(
    ("overrides", "generating", "engine_training"),
    [
        (["cluster.release_memory=on"], 10.0, 0.0),  # the trainer keeps its weights; the engine sleeps
        (["cluster.release_memory=on", "cluster.offload_params=true"], 0.0, 0.0),
        (["cluster.release_memory=off"], 60.0, 50.0),  # nothing released: both hold everything
    ],
)
def test_a_colocated_gpu_holds_each_phases_share(overrides, generating, engine_training):
    config = load_checked(
        RECIPES / "qwen3_30b_a3b.yaml",
        ["cluster.rollout_nodes=0", "cluster.nodes=2", *overrides],
        paths=False,
    )
    trainer = TrainerMemory(params=100, weights=10.0, grads=20.0, optimizer=30.0, activations=5.0)
    engine = RolloutMemory(weights_per_gpu=4.0, budget_per_gpu=50.0, kv_per_token=1.0)
    phases = colocated_memory(config, trainer, engine)
    assert phases.releases == (generating != 60.0)
    assert (phases.trainer_generating, phases.engine_generating) == (generating, 50.0)
    assert (phases.trainer_training, phases.engine_training) == (65.0, engine_training)
    assert phases.generate == generating + 50.0 and phases.train == 65.0 + engine_training
    assert phases.peak == max(phases.generate, phases.train)


def _activation_config(pp: int = 1, recompute: bool = False) -> RecipeConfig:
    """A GQA MoE of hand size: hidden 16, 2 heads and 1 KV head of 8, 2 layers (the first dense, MLP
    32), 4 experts of 8 (top-2) and 1 shared, a vocabulary of 10; micro-batches of 64 tokens; 8
    sequences of up to 24 + 8 tokens a step."""
    config = RecipeConfig()
    m = config.model
    m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim = 16, 2, 1, 8
    m.num_layers, m.first_k_dense_layers, m.ffn_hidden_size, m.moe_ffn_hidden_size = 2, 1, 32, 8
    m.num_experts, m.moe_router_topk, m.num_shared_experts, m.vocab_size = 4, 2, 1, 10
    p = config.parallel
    p.tensor_model_parallel_size = p.context_parallel_size = p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size, p.pipeline_model_parallel_size, p.trainer_world_size = 1, pp, pp
    config.trainer.max_tokens_per_microbatch, config.trainer.num_mini_batches = 64, 1
    config.trainer.recompute_activations = recompute
    config.rollout.batch_size, config.rollout.max_new_tokens, config.data.max_prompt_len = 8, 8, 24
    return config


def test_activations_by_hand():
    """Per token, attention keeps 2·16 + (2 + 2·1)·8 + 2·8 = 80 elements; the dense MLP 16 + 3·32 =
    112; the MoE MLP 2·4 (router) + 2·(16 + 3·8) (routed) + 1·(16 + 3·8) (shared) = 128. Logits and
    their gradient: 2·64·10 fp32. One stage: (80 + 112 + 80 + 128)·64 tokens·2 bytes + 5,120 =
    56,320; with recompute each layer keeps its input (2 layers·16) and one layer (the MoE one, 208)
    is recomputed at a time: (32 + 208)·64·2 + 5,120 = 35,840. Two stages (4 micro-batches of 64
    tokens, two in flight): stage 0's dense layer, 2·192·64·2 = 49,152, above half of it plus the
    logits."""
    from moe_rl.planner.memory import activation_bytes

    assert activation_bytes(_activation_config()) == 56_320
    assert activation_bytes(_activation_config(recompute=True)) == 35_840
    assert activation_bytes(_activation_config(pp=2)) == 49_152


def test_activations_by_hand_with_mla_and_with_tensor_parallelism():
    """MLA (2 heads of 4 + 2 rope dims, values of 4, a KV latent of 8, no query latent): attention
    keeps 2·16 + (2·6) + (8 + 2 + 2·(4 + 4)) + 2·6 + 2·4 = 90 elements a token, so one stage is
    (90 + 112 + 90 + 128)·64·2 + 5,120 = 58,880. TP 2 (sequence parallel) halves the layers' and the
    logits' share: (40 + 56 + 40 + 64)·64·2 + 2,560 = 28,160."""
    from moe_rl.planner.memory import activation_bytes

    mla = _activation_config()
    m = mla.model
    m.attention, m.kv_lora_rank, m.q_lora_rank = Attention.MLA, 8, None
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 4, 2, 4
    assert activation_bytes(mla) == 58_880
    tp = _activation_config()
    tp.parallel.tensor_model_parallel_size, tp.parallel.trainer_world_size = 2, 2
    assert activation_bytes(tp) == 28_160


def test_a_trainer_gpu_holds_its_share_of_the_experts_and_all_of_its_dense_weights():
    """EP 2 x ETP 2 over 4 GPUs: each holds a quarter of the 240 expert weights and every one of the
    466 others (embedding, head, norms, attention, the dense MLP, routers)."""
    from moe_rl.planner.memory import trainer_memory

    config = RecipeConfig()
    p = config.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.context_parallel_size = 1
    p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.trainer_world_size = 2, 2, 4
    memory = trainer_memory(config, COUNTS)
    assert memory.params == 466 + 240 // 4 and memory.adapters == 0 and memory.critic == memory.teacher == 0.0
    with pytest.raises(AttributeError):
        memory.params = 0  # a value
    from moe_rl.planner.memory import layout

    lay = layout(config)
    assert (lay.ep, lay.etp, lay.dp, lay.expert_dp) == (2, 2, 4, 1)
    with pytest.raises(AttributeError):
        lay.ep = 1


def test_a_dense_model_keeps_no_routing_trace():
    from moe_rl.planner.memory import routing_trace_bytes_per_token

    assert routing_trace_bytes_per_token(ModelConfig(num_experts=0)) == 0
    assert (
        routing_trace_bytes_per_token(ModelConfig(num_layers=3, first_k_dense_layers=1, num_experts=1))
        == 2 * 2
    )
