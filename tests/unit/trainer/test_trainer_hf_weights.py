"""HF <-> Megatron weights: the mapping tables, exact round trips, logits equal to transformers'
(the transformers reference on the CPU, the Megatron model on each device)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_config_testing import hf_config_to_model_config

transformers = pytest.importorskip("transformers")

from moe_rl.megatron.hf_weights import (  # noqa: E402
    SafetensorsReader,
    fuse,
    hf_names_for,
    iter_hf_weights,
    load_hf_checkpoint,
    load_hf_weights,
    save_hf_checkpoint,
    split,
)
from moe_rl.megatron.model import build_gpt_model  # noqa: E402

VOCAB, SEQ = 64, 11
pytestmark = pytest.mark.usefixtures("device")


def _qwen3_hf():
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _deepseek_hf():
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=4,
        first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)  # make the selection bias matter
    return model


HF_MODELS = {"qwen3_moe": _qwen3_hf, "deepseek_v3": _deepseek_hf}


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_folder(request, tmp_path_factory):
    """(family, HF model, folder written by save_pretrained)."""
    model = HF_MODELS[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _megatron_from(folder):
    config = json.loads((folder / "config.json").read_text())
    model = build_gpt_model(hf_config_to_model_config(config), seed=7).eval()
    load_hf_checkpoint(model, folder)
    return model


def _logits(model, tokens, megatron: bool):
    """Logits on the CPU; a Megatron model gets the tokens on its own device."""
    with torch.no_grad():
        if megatron:
            device = next(model.parameters()).device
            tokens = tokens.to(device)
            positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
            return model(tokens, positions, attention_mask=None).cpu()
        return model(tokens).logits


def test_hf_logits_equal_megatron_logits(hf_folder, device):
    _, hf_model, folder = hf_folder
    megatron = _megatron_from(folder)
    assert next(megatron.parameters()).device.type == device.type
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref, out = _logits(hf_model, tokens, False), _logits(megatron, tokens, True)
    assert (ref - out).abs().max() < (1e-5 if device.type == "cpu" else 1e-4)


def test_round_trip_is_exact(hf_folder):
    _, _, folder = hf_folder
    exported = dict(iter_hf_weights(_megatron_from(folder)))
    original = SafetensorsReader(folder)
    assert set(exported) == set(original)
    for name, tensor in exported.items():
        assert torch.equal(tensor.cpu(), original[name]), name


def test_save_hf_checkpoint_loads_in_transformers(hf_folder, tmp_path):
    _family, hf_model, folder = hf_folder
    megatron = _megatron_from(folder)
    config = json.loads((folder / "config.json").read_text())
    out = save_hf_checkpoint(megatron, tmp_path / "export", config, max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()  # several shards
    reloaded = type(hf_model).from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(reloaded, tokens, False), _logits(hf_model, tokens, False))


def test_qkv_and_glu_fusions_invert():
    class Config:
        num_attention_heads, num_query_groups, kv_channels = 4, 2, 3

    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    fused = fuse("qkv", [q, k, v], Config)
    # group 0: q heads 0, 1, then k head 0, then v head 0
    torch.testing.assert_close(fused[:6], q[:6])
    torch.testing.assert_close(fused[6:9], k[:3])
    torch.testing.assert_close(fused[9:12], v[:3])
    assert all(torch.equal(a, b) for a, b in zip(split("qkv", fused, Config), [q, k, v]))
    gate, up = torch.randn(4, 5), torch.randn(4, 5)
    assert all(
        torch.equal(a, b) for a, b in zip(split("glu", fuse("glu", [gate, up], Config), Config), [gate, up])
    )


def test_mapping_names_are_global():
    from trainer_testing import tiny_deepseek

    model = build_gpt_model(tiny_deepseek(), seed=1)
    assert hf_names_for(model, "decoder.layers.0.mlp.linear_fc1.weight").hf == (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    rule = hf_names_for(model, "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight")
    assert rule.hf == ("model.layers.2.mlp.experts.5.down_proj.weight",)
    assert hf_names_for(model, "decoder.layers.1.mlp.router.expert_bias").hf == (
        "model.layers.1.mlp.gate.e_score_correction_bias",
    )


def test_bad_hf_weights_are_named(hf_folder):
    _family, _, folder = hf_folder
    weights = dict(SafetensorsReader(folder))
    model = build_gpt_model(
        hf_config_to_model_config(json.loads((folder / "config.json").read_text())), seed=1
    )
    missing = dict(weights)
    missing.pop("model.layers.1.mlp.gate.weight")
    with pytest.raises(ValueError, match=r"lack \['model.layers.1.mlp.gate.weight'\]"):
        load_hf_weights(model, missing)
    wrong = {**weights, "model.norm.weight": torch.ones(5)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_weights(model, wrong)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        load_hf_weights(model, {**weights, "model.extra.weight": torch.ones(1)})
    mtp = {**weights, "model.layers.99.eh_proj.weight": torch.ones(1)}  # multi-token prediction: ignored
    load_hf_weights(model, mtp)
