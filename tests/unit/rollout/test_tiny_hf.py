"""The tiny Hugging Face checkpoint maker."""

from __future__ import annotations

import json

import pytest
import torch

from moe_rl.config.schema import ModelConfig
from moe_rl.rollout.tiny_hf import load_state_dict, make_tiny_qwen3_moe, qwen3_moe_kwargs


def test_tiny_checkpoint_is_seeded_safetensors_with_the_asked_shape(tmp_path):
    a = load_state_dict(make_tiny_qwen3_moe(tmp_path / "a", seed=3))
    b = load_state_dict(make_tiny_qwen3_moe(tmp_path / "b", seed=3))
    c = load_state_dict(make_tiny_qwen3_moe(tmp_path / "c", seed=4, vocab_size=64))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], c["model.layers.0.mlp.gate.weight"])
    assert a["lm_head.weight"].shape == (128, 64) and c["lm_head.weight"].shape == (64, 64)
    assert a["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["eos_token_id"] is None
    assert (config["num_experts_per_tok"], config["head_dim"], config["num_hidden_layers"]) == (2, 32, 2)
    assert not list((tmp_path / "a").glob("tokenizer*"))


def test_checkpoint_from_a_recipe_model_section(tmp_path):
    model = ModelConfig(vocab_size=96, head_dim=32, num_experts=4, moe_router_topk=1, first_k_dense_layers=1)
    kwargs = qwen3_moe_kwargs(model)
    assert kwargs["mlp_only_layers"] == [0] and kwargs["num_experts"] == 4
    state = load_state_dict(make_tiny_qwen3_moe(tmp_path, seed=0, **kwargs))
    assert "model.layers.0.mlp.down_proj.weight" in state  # dense first layer
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in state


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="family=qwen3_moe"):
        qwen3_moe_kwargs(ModelConfig(family="deepseek_v3", attention="mla"))
    with pytest.raises(ValueError, match=r"unknown overrides \['hidden'\]"):
        make_tiny_qwen3_moe(tmp_path, hidden=3)
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_state_dict(tmp_path)
