"""The large recipes and their CPU twins: composition, published architecture numbers, the
stability stack, one-override quant switches, and twins that keep every layer type at toy size.

Running two RL steps of each twin (R3 + KSM + ESPO on CPU) belongs with the RL loop's end-to-end
tests; here each twin loads, validates and plans."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch.plan import make_plan
from moe_rl.config import ConfigError
from moe_rl.orchestration.preflight import load_checked

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
LARGE = ["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "kimi_k2"]


@pytest.mark.parametrize("name", LARGE)
def test_large_recipe_is_composed_of_pieces(name):
    defaults = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["defaults"]
    assert defaults[0] == f"model/{name}" and "algo/stability_stack" in defaults
    assert any(d.startswith("cluster/") for d in defaults)


@pytest.mark.parametrize("name", LARGE)
def test_large_recipe_runs_the_stability_stack_with_fp8_rollouts(name):
    c = load_checked(RECIPES / f"{name}.yaml", paths=False)
    assert (c.run.device, c.rollout.engine, c.cluster.gpus_per_node) == ("cuda", "vllm", 8)
    assert c.rollout.quant == "fp8_block128" and (c.quant.method, c.quant.granularity) == ("fp8", "block")
    a = c.algo
    assert (a.routing_replay, a.objective) == ("r3", "espo")
    assert a.corrections.keep_sampling_mask and a.corrections.icepop.enabled and a.corrections.opsm.enabled
    assert c.parallel.use_distributed_optimizer and c.parallel.sequence_parallel


@pytest.mark.parametrize("name", LARGE)
@pytest.mark.parametrize("quant", ["bf16", "fp8_tensor", "nvfp4"])
def test_quant_switch_is_one_override(name, quant):
    c = load_checked(RECIPES / f"{name}.yaml", [f"rollout.quant={quant}"], paths=False)
    assert c.quant.name == quant
    plan = make_plan(c, paths=False)
    if quant == "bf16" and name in ("deepseek_v3", "kimi_k2"):  # bf16 weights outgrow TP-16 engines
        assert {f.name for f in plan.failures} == {"rollout weights fit", "KV cache holds a sequence"}
    else:
        assert plan.ok, [f.name for f in plan.failures]


@pytest.mark.parametrize("name", LARGE)
def test_a_quant_recipe_the_engine_cannot_run_is_refused_at_load(name):
    with pytest.raises(
        ConfigError, match=r"engine: rollout.engine=vllm on cuda .*int4_awq.*rollout.engine=megatron"
    ):
        load_checked(RECIPES / f"{name}.yaml", ["rollout.quant=int4_awq"], paths=False)


def _fields(m, names: str) -> tuple:
    return tuple(getattr(m, n) for n in names.split())


def test_published_architecture_numbers():
    ds = load_checked(RECIPES / "deepseek_v3.yaml", paths=False).model
    assert _fields(ds, "num_layers hidden_size num_attention_heads vocab_size") == (61, 7168, 128, 129280)
    assert _fields(ds, "num_experts moe_router_topk moe_ffn_hidden_size num_shared_experts") == (
        256,
        8,
        2048,
        1,
    )
    assert _fields(ds, "moe_router_num_groups moe_router_group_topk first_k_dense_layers") == (8, 4, 3)
    assert _fields(ds, "q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim") == (1536, 512, 128, 64)
    k2 = load_checked(RECIPES / "kimi_k2.yaml", paths=False).model
    assert _fields(k2, "num_experts moe_router_topk moe_router_num_groups num_attention_heads") == (
        384,
        8,
        1,
        64,
    )
    assert _fields(k2, "first_k_dense_layers vocab_size moe_router_topk_scaling_factor") == (1, 163840, 2.827)
    q = load_checked(RECIPES / "qwen3_235b_a22b.yaml", paths=False).model
    assert _fields(q, "num_layers hidden_size num_attention_heads num_key_value_heads") == (94, 4096, 64, 4)
    assert _fields(q, "num_experts moe_router_topk moe_ffn_hidden_size") == (128, 8, 1536)
    q = load_checked(RECIPES / "qwen3_30b_a3b.yaml", paths=False).model
    assert _fields(q, "num_layers hidden_size num_attention_heads moe_ffn_hidden_size") == (48, 2048, 32, 768)


def _structure(m) -> dict:
    return {
        "family": m.family,
        "attention": m.attention,
        "query LoRA": m.q_lora_rank is not None,
        "score": m.moe_router_score_function,
        "expert bias": m.moe_router_enable_expert_bias,
        "group-limited routing": (m.moe_router_num_groups or 1) > 1,
        "routing groups set": m.moe_router_num_groups is not None,
        "shared experts": m.num_shared_experts > 0,
        "dense first layers": m.first_k_dense_layers > 0,
        "top-k scaling": m.moe_router_topk_scaling_factor is not None,
        "renormalized top-k": m.norm_topk_prob,
        "tied embeddings": m.tie_word_embeddings,
    }


@pytest.mark.parametrize("name", LARGE)
def test_twin_has_the_layer_types_of_its_recipe_at_toy_size(name):
    big = load_checked(RECIPES / f"{name}.yaml", paths=False).model
    twin = load_checked(RECIPES / "twins" / f"{name}.yaml", paths=False).model
    assert _structure(twin) == _structure(big)
    assert 32 <= twin.hidden_size <= 64 and twin.vocab_size <= 256
    assert twin.num_layers < big.num_layers and twin.num_experts < big.num_experts
    assert twin.moe_router_topk < twin.num_experts


@pytest.mark.parametrize("name", LARGE)
def test_twin_runs_r3_ksm_espo_anywhere(name):
    c = load_checked(RECIPES / "twins" / f"{name}.yaml", paths=False)
    assert (c.run.device, c.rollout.engine, c.run.steps) == ("auto", "megatron", 2)
    assert (c.algo.routing_replay, c.algo.objective) == ("r3", "espo")
    assert c.algo.corrections.keep_sampling_mask
    assert c.parallel.trainer_world_size == 1 and c.cluster.gpus_per_node == 0
    assert make_plan(c).ok
