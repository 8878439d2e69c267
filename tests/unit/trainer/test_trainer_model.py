"""Model build from ModelConfig (Qwen3-MoE, DeepSeek-V3) and HF config translation."""

from __future__ import annotations

import pytest
import torch
from hf_config_testing import hf_config_to_model_config
from trainer_testing import tiny_deepseek, tiny_qwen

from moe_rl.megatron.forward import forward_logits
from moe_rl.megatron.model import build_gpt_model, moe_layer_pattern, transformer_config


def _tokens(n: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_qwen3_config_maps_router_and_attention():
    config = transformer_config(tiny_qwen())
    assert config.qk_layernorm and config.num_query_groups == 2 and config.kv_channels == 8
    assert config.moe_router_score_function == "softmax"
    assert config.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the top-k logits
    assert transformer_config(tiny_qwen(norm_topk_prob=False)).moe_router_pre_softmax is True
    assert config.add_bias_linear is False and config.moe_enable_routing_replay


def test_deepseek_config_has_mla_shared_experts_and_group_routing():
    config = transformer_config(tiny_deepseek())
    assert config.multi_latent_attention and config.q_lora_rank == 16 and config.qk_pos_emb_head_dim == 4
    assert config.moe_layer_freq == [0, 1, 1]
    assert config.moe_shared_expert_intermediate_size == 16
    assert config.moe_router_enable_expert_bias and config.moe_router_num_groups == 4
    assert config.moe_router_topk_scaling_factor == 2.5


def test_layer_pattern():
    assert moe_layer_pattern(tiny_deepseek(num_layers=5, first_k_dense_layers=3)) == [0, 0, 0, 1, 1]
    assert moe_layer_pattern(tiny_qwen()) == [1, 1]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_init_is_deterministic_per_seed(family, device):
    cfg = tiny_qwen() if family == "qwen3_moe" else tiny_deepseek()
    a, b, c = (build_gpt_model(cfg, seed=s).state_dict() for s in (5, 5, 6))
    assert a["embedding.word_embeddings.weight"].device.type == device.type
    name = "decoder.layers.1.mlp.router.weight"
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert not torch.equal(a[name], c[name])


# YaRN past a 4-token original context: packed sequences restart their rotary positions.
TINY_YARN = {
    "rope_scaling_type": "yarn",
    "rope_scaling_factor": 4.0,
    "rope_original_max_position_embeddings": 4,
}
PACKED_MODELS = {
    "qwen3_moe": tiny_qwen,
    "deepseek_v3": tiny_deepseek,
    "deepseek_v3_yarn": lambda: tiny_deepseek(**TINY_YARN, rope_mscale=0.8, rope_mscale_all_dim=0.5),
}


@pytest.mark.parametrize("family", sorted(PACKED_MODELS))
def test_packed_forward_equals_per_sequence_forward(family, device, monkeypatch):
    """Every layer attends within each packed sequence, through one layout made once per forward
    (`PackedLayout.of`: building it waits for the device)."""
    from moe_rl.data.packing import MicroBatch
    from moe_rl.megatron.attention import PackedLayout

    built = []
    build = PackedLayout.build
    monkeypatch.setattr(PackedLayout, "build", staticmethod(lambda *a: built.append(a) or build(*a)))

    cfg = PACKED_MODELS[family]()
    model = build_gpt_model(cfg, seed=1).eval()
    lengths = [4, 7, 3]
    tokens = _tokens(sum(lengths))
    cu = torch.tensor([0, 4, 11, 14], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    micro = MicroBatch(
        sample_indices=torch.arange(3), input_ids=tokens, position_ids=positions, cu_seqlens=cu,
        loss_mask=torch.zeros(14, dtype=torch.bool), response_positions=torch.tensor([], dtype=torch.long),
        response_offsets=torch.zeros(4, dtype=torch.long), response_token_index=torch.tensor([], dtype=torch.long),
        rollout_logp=torch.zeros(0), token_versions=torch.zeros(0, dtype=torch.long),
    ).to(device)  # fmt: skip
    tokens = micro.input_ids
    with torch.no_grad():
        packed = forward_logits(model, micro)
        single = [
            model(s[None], torch.arange(len(s), device=device)[None], attention_mask=None)[0]
            for s in tokens.split(lengths)
        ]
    tol = 1e-5 if device.type == "cpu" else 1e-4
    torch.testing.assert_close(packed, torch.cat(single), atol=tol, rtol=tol)
    assert cfg.num_layers > 1 and len(built) == 1  # the packed forward's; the single ones are unpacked


def test_model_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.family"):
        transformer_config(tiny_qwen(family="llama"))
    with pytest.raises(ValueError, match="moe_router_topk"):
        transformer_config(tiny_qwen(moe_router_topk=9))
    with pytest.raises(ValueError, match="attention"):
        transformer_config(tiny_qwen(family="deepseek_v3"))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        transformer_config(tiny_deepseek(norm_topk_prob=False))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_config_to_hf_config_inverts(family):
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from moe_rl.megatron.model import model_config_to_hf_config

    cfg = tiny_qwen() if family == "qwen3_moe" else tiny_deepseek()
    hf = model_config_to_hf_config(cfg)
    back = hf_config_to_model_config(hf)
    assert dataclasses.replace(back, head_dim=cfg.head_dim) == cfg  # head_dim is GQA-only
    assert transformers.AutoConfig.for_model(**hf).model_type == family
