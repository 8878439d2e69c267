"""YaRN rotary scaling (DeepSeek-V3, Kimi-K2): logits equal to transformers' beyond the original
context, the HF config the trainer writes, and named errors for what the trainer cannot express."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_config_testing import hf_config_to_model_config
from trainer_testing import DEEPSEEK_V3_HF as DEEPSEEK_V3_BASE_HF
from trainer_testing import tiny_deepseek, tiny_qwen

from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config, transformer_config

transformers = pytest.importorskip("transformers")

VOCAB, ORIGINAL, FACTOR, SEQ = 64, 32, 4.0, 80  # SEQ runs past the original 32-token context

YARN = {
    "rope_scaling_type": "yarn",
    "rope_scaling_factor": FACTOR,
    "rope_original_max_position_embeddings": ORIGINAL,
}

# The rope_scaling dicts of the published config.json files.
DEEPSEEK_V3_ROPE = {
    "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
KIMI_K2_ROPE = {**DEEPSEEK_V3_ROPE, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0}

DEEPSEEK_V3_HF = {**DEEPSEEK_V3_BASE_HF, "rope_scaling": DEEPSEEK_V3_ROPE}
KIMI_K2_HF = {
    **DEEPSEEK_V3_HF, "model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
    "rope_theta": 50000.0, "max_position_embeddings": 131072, "rope_scaling": KIMI_K2_ROPE,
}  # fmt: skip


def _deepseek_hf(mscale: float, mscale_all_dim: float):
    """A tiny DeepSeek-V3 with YaRN. Rotary width 8 with base 100 puts the ramp between the kept and
    the interpolated frequencies inside the head (r = 1, 0.5, 0, 0); initializer range 0.2 makes
    attention, and so the rotary scaling, move the logits by several units."""
    rope = {
        "rope_type": "yarn", "rope_theta": 100.0, "factor": FACTOR, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
    }  # fmt: skip
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=4,
        first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
        max_position_embeddings=int(ORIGINAL * FACTOR), rope_parameters=rope, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def _megatron_logits(model_config, folder, tokens):
    from moe_rl.megatron.hf_weights import load_hf_checkpoint

    model = build_gpt_model(model_config, seed=7).eval()
    load_hf_checkpoint(model, folder)
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        return model(tokens, positions, attention_mask=None).cpu()


@pytest.mark.parametrize(
    ("mscale", "mscale_all_dim"),
    [(1.0, 1.0), (1.0, 0.0), (0.8, 0.5)],
    ids=["deepseek-v3", "cos-sin-factor", "both-factors"],
)
def test_yarn_logits_equal_transformers(mscale, mscale_all_dim, tmp_path, device):
    """(1, 1): softmax scale m(1)^2, cos/sin unscaled (the published configs); (1, 0): cos/sin
    times m(1), softmax unscaled; (0.8, 0.5): both, with cos/sin times m(0.8) / m(0.5)."""
    hf_model = _deepseek_hf(mscale, mscale_all_dim)
    hf_model.save_pretrained(tmp_path)
    config = hf_config_to_model_config(json.loads((tmp_path / "config.json").read_text()))
    assert (config.rope_scaling_type, config.rope_mscale, config.rope_mscale_all_dim) == (
        "yarn",
        mscale,
        mscale_all_dim,
    )
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    out = _megatron_logits(config, tmp_path, tokens)
    assert (ref - out).abs().max() < (1e-5 if device.type == "cpu" else 1e-4)
    plain = _megatron_logits(dataclasses.replace(config, rope_scaling_type="none"), tmp_path, tokens)
    assert (ref - plain).abs().max() > 0.1  # the comparison sees the rotary scaling


def test_yarn_maps_onto_megatron_mla_config():
    config = transformer_config(tiny_deepseek(**YARN, rope_mscale=0.8, rope_mscale_all_dim=0.5))
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == (
        "yarn",
        FACTOR,
        ORIGINAL,
    )
    assert (config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim) == (32.0, 1.0, 0.8, 0.5)
    plain = transformer_config(tiny_deepseek())
    assert (plain.rope_type, plain.rotary_scaling_factor) == ("rope", 1.0)  # softmax scale m(1) = 1


@pytest.mark.parametrize(("hf", "rope"), [(DEEPSEEK_V3_HF, DEEPSEEK_V3_ROPE), (KIMI_K2_HF, KIMI_K2_ROPE)])
def test_published_rope_scaling_round_trips(hf, rope):
    config = hf_config_to_model_config(hf)
    assert (config.rope_scaling_type, config.rope_scaling_factor, config.rope_beta_fast) == (
        "yarn",
        rope["factor"],
        rope["beta_fast"],
    )
    back = model_config_to_hf_config(config)
    assert back["rope_scaling"] == {**rope, "rope_type": "yarn"}
    assert (back["rope_theta"], back["max_position_embeddings"]) == (
        hf["rope_theta"],
        hf["max_position_embeddings"],
    )
    assert hf_config_to_model_config(back) == config
    params = transformers.DeepseekV3Config.from_dict(back).rope_parameters
    assert {k: params[k] for k in rope if k != "type"} == {k: v for k, v in rope.items() if k != "type"}
    assert params["rope_theta"] == hf["rope_theta"]


def test_tiny_yarn_config_round_trips():
    config = tiny_deepseek(**YARN, rope_beta_fast=8.0, rope_mscale=0.8, rope_mscale_all_dim=0.5)
    back = hf_config_to_model_config(model_config_to_hf_config(config))
    assert dataclasses.replace(back, head_dim=config.head_dim) == config  # head_dim is GQA-only
    assert "rope_scaling" not in model_config_to_hf_config(tiny_deepseek())


def test_yarn_on_gqa_is_refused():
    with pytest.raises(ValueError, match="model.rope_scaling_type=yarn needs model.attention=mla"):
        transformer_config(tiny_qwen(**YARN))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rope_scaling_factor": 0.0}, "model.rope_scaling_factor=0.0 must be > 0"),
        ({"rope_original_max_position_embeddings": None}, "model.rope_original_max_position_embeddings=None"),
        ({"rope_mscale": 0.0, "rope_mscale_all_dim": 1.0}, "model.rope_mscale=0.0"),
        ({"rope_mscale": 0.8, "rope_mscale_all_dim": 0}, "model.rope_mscale=0.8"),
        ({"rope_beta_slow": 0}, "model.rope_beta_slow=0"),
        ({"rope_scaling_type": "ntk"}, "model.rope_scaling_type='ntk'"),
    ],
)
def test_bad_yarn_model_config_is_named(changes, expected):
    with pytest.raises(ValueError, match=expected):
        transformer_config(tiny_deepseek(**{**YARN, **changes}))
