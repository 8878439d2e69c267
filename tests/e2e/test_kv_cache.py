"""KV-cached decoding of the Megatron engine equals the recompute path: for one seed, the same tokens,
finish reasons, routing traces and kept sets, and log-probs within float tolerance, on tiny qwen3_moe
and deepseek_v3 (MLA) models, the latter with and without YaRN; responses reach
max_position_embeddings; the attention layers use the cache the budget counts, and one that does not
fit is refused with its numbers; a core attention that ignores masks decodes by recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.megatron.decoding import (
    KVCacheDecoder,
    KVCacheSize,
    attention_layers,
    kv_bytes_per_slot,
    kv_cache_unsupported,
)
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import Decoding, MegatronEngine

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("device")]

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe.yaml"
MAX_POSITIONS = 64
DEEPSEEK = [
    "model.family=deepseek_v3", "model.attention=mla", "model.num_layers=3", "model.first_k_dense_layers=1",
    "model.num_key_value_heads=4", "model.num_shared_experts=1", "model.moe_router_topk=4",
    "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
    "model.moe_router_num_groups=4", "model.moe_router_group_topk=2", "model.moe_router_topk_scaling_factor=2.5",
    "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
    "model.v_head_dim=8",
]  # fmt: skip
YARN = [
    *DEEPSEEK, "model.rope_scaling_type=yarn", "model.rope_scaling_factor=4.0",
    "model.rope_original_max_position_embeddings=16", "model.rope_mscale=1.0", "model.rope_mscale_all_dim=1.0",
]  # fmt: skip
MODELS = {"qwen3_moe": [], "deepseek_v3": DEEPSEEK, "deepseek_v3_yarn": YARN}
# lengths 1..6: every prefill row but the longest is left-padded
PROMPTS = [[1, *[3 + (i * 5 + j) % 12 for j in range(i % 6)]] for i in range(8)]


def recipe(model: list[str], *overrides: str):
    return load_checked(
        TINY, ["rollout.quant=bf16", f"model.max_position_embeddings={MAX_POSITIONS}", *model, *overrides]
    )


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request) -> tuple[MegatronEngine, MegatronEngine]:
    """The KV-cached engine and the recompute engine, same weights."""
    config = recipe(MODELS[request.param])
    cached = MegatronEngine(config, decoding=Decoding.KV_CACHE)
    recompute = MegatronEngine(config, decoding=Decoding.RECOMPUTE)
    with torch.no_grad():
        for mine, theirs in zip(recompute.model.parameters(), cached.model.parameters(), strict=True):
            mine.copy_(theirs)
    return cached, recompute


def assert_same_rollouts(cached, recompute) -> None:
    assert torch.equal(cached.response_ids, recompute.response_ids)
    assert cached.finish_reasons == recompute.finish_reasons
    torch.testing.assert_close(cached.rollout_logp, recompute.rollout_logp, atol=1e-5, rtol=0)
    assert torch.equal(cached.routed_experts, recompute.routed_experts)
    assert torch.equal(cached.sampling_mask_ids, recompute.sampling_mask_ids)
    assert torch.equal(cached.sampling_mask_offsets, recompute.sampling_mask_offsets)


def test_kv_cache_equals_recompute(engines):
    """Left-padded prompts, top-k / top-p sampling, sequences stopping at different steps."""
    cached, recompute = engines
    spec = SamplingSpec(
        temperature=1.0, top_k=8, top_p=0.9, max_new_tokens=10, n=2, seed=3, stop_token_ids=(2,)
    )
    a, b = cached.generate(PROMPTS, spec), recompute.generate(PROMPTS, spec)
    assert_same_rollouts(a, b)
    # the last sampled token is never forwarded
    assert torch.equal(a.routing_lengths(), a.sequence_lengths() - 1)
    assert set(a.finish_reasons) == {"stop", "length"}  # sequences left the batch mid-way


def test_responses_reach_max_position_embeddings(engines):
    """Prompts of one length (no padding, Megatron's causal prefill) + max_new_tokens fill the
    model's whole context; YaRN runs past its original context."""
    cached, recompute = engines
    prompts = [[p[0], 4, 5, 6] for p in PROMPTS[:3]]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=MAX_POSITIONS - 4, n=1, seed=4)
    a, b = cached.generate(prompts, spec), recompute.generate(prompts, spec)
    assert_same_rollouts(a, b)
    assert (a.response_lengths() == MAX_POSITIONS - 4).all()


def test_the_layers_use_the_cache_the_budget_counts(engines):
    """One key and one value buffer per attention layer, under the layer numbers Megatron looks up
    (a miss would make Megatron allocate more), of the size `KVCacheSize` checks."""
    cached, _ = engines
    decoder = KVCacheDecoder(cached.model, None, cached.device, limit_gib=1.0)
    decoder.prefill(PROMPTS, max_new_tokens=5)
    expected = KVCacheSize(rows=len(PROMPTS), slots=6 + 5 - 1, bytes_per_slot=kv_bytes_per_slot(cached.model))
    buffers = decoder.context.key_value_memory_dict
    assert sorted(buffers) == sorted(layer.layer_number for layer in attention_layers(cached.model))
    assert sum(t.numel() * t.element_size() for pair in buffers.values() for t in pair) == expected.nbytes > 0


def test_a_cache_that_does_not_fit_is_refused_with_its_numbers():
    engine = MegatronEngine(recipe([], "rollout.megatron_kv_cache_gib=0.0001"))
    assert engine.decoding is Decoding.KV_CACHE
    per_slot = kv_bytes_per_slot(engine.model)  # 2 layers x (K + V) x 2 groups x 16 x fp32
    assert per_slot == 2 * 2 * 2 * 16 * 4
    with pytest.raises(ValueError, match=r"needs 0\.0\d+ GiB: 64 sequences x 63 slots") as info:
        engine.generate([[1] * 4] * 16, SamplingSpec(max_new_tokens=60, n=4))
    assert f"x {per_slot} bytes per slot" in str(info.value)
    assert "rollout.megatron_kv_cache_gib=0.0001" in str(info.value)


def test_decoding_is_typed():
    with pytest.raises(ValueError, match="decoding='recompute'; expected one of Decoding.KV_CACHE"):
        MegatronEngine(recipe([]), decoding="recompute")


class MaskIgnoringAttention(torch.nn.Module):
    """Stands for a core attention that applies its own mask type only (transformer-engine's)."""


def test_a_core_attention_that_ignores_masks_decodes_by_recompute():
    engine = MegatronEngine(recipe([]))
    engine.model.decoder.layers[0].self_attention.core_attention = MaskIgnoringAttention()
    assert "MaskIgnoringAttention" in kv_cache_unsupported(engine.model)
    assert engine._check_decoding(None) is Decoding.RECOMPUTE
    with pytest.raises(ValueError, match="decoding=Decoding.KV_CACHE: the model's core attention is Mask"):
        engine._check_decoding(Decoding.KV_CACHE)
