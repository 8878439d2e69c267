"""Model FLOPs (`moe_rl.planner.flops`): a hand count of a small GQA MoE, of a small MLA MoE
with a dense first layer and a shared expert and of one without the query's low-rank path, the
causal pair count, and the shipped recipes against their published activated parameter counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config.schema import ModelConfig
from moe_rl.orchestration.preflight import load_checked
from moe_rl.planner.flops import causal_pairs, model_flops

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def test_gqa_moe_by_hand():
    # hidden 8, 2 layers, 4 heads of 2 (2 KV heads), 6 experts top-2 of width 3, vocab 10
    model = ModelConfig(
        family="qwen3_moe", vocab_size=10, hidden_size=8, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=2, ffn_hidden_size=12, moe_ffn_hidden_size=3, num_experts=6,
        moe_router_topk=2,
    )  # fmt: skip
    f = model_flops(model)
    # per layer: q 8x8, k and v 8x4 each, o 8x8 = 192 multiply-adds
    assert f.attention == 2 * 2 * 192
    assert f.router == 2 * 2 * 8 * 6
    assert f.experts == 2 * 2 * 2 * (8 * 3 * 2 + 3 * 8)  # top-2 of (gate+up 8->2x3, down 3->8)
    assert f.shared_experts == f.dense_mlp == 0
    assert f.output == 2 * 8 * 10
    assert f.per_pair == 2 * 2 * (4 * 2 + 4 * 2)  # scores and values: heads x head_dim each
    assert f.per_token == 768 + 192 + 576 + 160
    # two sequences of 3 and 1 tokens: 6 + 1 query-key pairs
    assert f.forward([3, 1]) == 4 * f.per_token + 7 * f.per_pair
    assert f.forward_backward([3, 1]) == 3 * f.forward([3, 1])


def test_mla_moe_with_a_dense_layer_and_a_shared_expert_by_hand():
    model = ModelConfig(
        family="deepseek_v3", attention="mla", vocab_size=10, hidden_size=8, num_layers=3,
        num_attention_heads=2, num_key_value_heads=2, ffn_hidden_size=12, moe_ffn_hidden_size=3,
        num_experts=4, moe_router_topk=2, first_k_dense_layers=1, num_shared_experts=1, q_lora_rank=4,
        kv_lora_rank=5, qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3,
    )  # fmt: skip
    f = model_flops(model)
    # q: 8->4->2x(3+2); kv: 8->(5+2), 5->2x(3+3); o: 2x3->8
    per_layer = 8 * 4 + 4 * 2 * 5 + 8 * 7 + 5 * 2 * 6 + 6 * 8
    assert f.attention == 2 * 3 * per_layer
    assert f.router == 2 * 2 * 8 * 4  # the two MoE layers
    assert f.experts == 2 * 2 * 2 * 3 * 8 * 3
    assert f.shared_experts == 2 * 2 * 1 * 3 * 8 * 3
    assert f.dense_mlp == 2 * 1 * 3 * 8 * 12
    assert f.per_pair == 2 * 3 * 2 * (5 + 3)


def test_mla_without_a_query_low_rank_path_by_hand():
    """``q_lora_rank: null`` (DeepSeek-V2-Lite): the query is projected from the hidden state directly."""
    model = ModelConfig(
        family="deepseek_v3", attention="mla", vocab_size=10, hidden_size=8, num_layers=2,
        num_attention_heads=2, num_key_value_heads=2, ffn_hidden_size=12, moe_ffn_hidden_size=3,
        num_experts=4, moe_router_topk=2, q_lora_rank=None, kv_lora_rank=5, qk_nope_head_dim=3,
        qk_rope_head_dim=2, v_head_dim=3,
    )  # fmt: skip
    f = model_flops(model)
    # q: 8->2x(3+2) = 80; kv: 8->(5+2) = 56, 5->2x(3+3) = 60; o: 2x3->8 = 48
    assert f.attention == 2 * 2 * (80 + 56 + 60 + 48)
    assert f.per_pair == 2 * 2 * 2 * (5 + 3)


def test_causal_pairs():
    assert causal_pairs([]) == 0
    assert causal_pairs([1, 2, 4]) == 1 + 3 + 10


@pytest.mark.parametrize(
    ("recipe", "activated"),
    [("deepseek_v3", 37e9), ("kimi_k2", 32e9), ("qwen3_30b_a3b", 3.3e9), ("qwen3_235b_a22b", 22e9)],
)
def test_shipped_models_match_their_published_activated_parameters(recipe, activated):
    """Forward FLOPs per token are twice the weights a token meets; with the input embedding (a
    lookup, no FLOPs) those are the model card's activated parameters (norms aside, which the
    cards count: within 3 %)."""
    model = load_checked(RECIPES / f"{recipe}.yaml", paths=False).model
    met = model_flops(model).per_token / 2 + model.vocab_size * model.hidden_size
    assert met == pytest.approx(activated, rel=0.03)


def test_the_mid_bench_model_is_about_0_2_gflop_per_token():
    """bench/trainer_step.py --size mid: 4 layers, hidden 1024, 64 experts top-8 of width 512,
    16 heads (4 KV) of 64, vocab 32,768 at 512-token sequences."""
    model = ModelConfig(
        family="qwen3_moe", vocab_size=32768, hidden_size=1024, num_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, ffn_hidden_size=2048, moe_ffn_hidden_size=512, num_experts=64,
        moe_router_topk=8,
    )  # fmt: skip
    f = model_flops(model)
    per_token = f.forward([512]) / 512
    assert per_token == pytest.approx(0.195e9, rel=0.01)
    assert f.experts / f.per_token == pytest.approx(0.53, abs=0.01)  # the experts are half the work
