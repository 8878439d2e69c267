"""The PEFT adapter folder of a LoRA model (`moe_rl.megatron.peft_adapter`) from the adapters as a
sync carries them (`hf_weights`: a fused linear's ``A`` once, under its first HF linear): every HF
linear gets its own ``B`` and a copy of that ``A``, the folder's config names the recipe's rank and
alpha. The folder against vLLM and the merged model is `tests/e2e/test_export_to_vllm.py`."""

from __future__ import annotations

import json

import pytest
import torch

from moe_rl.config.schema import LoraConfig
from moe_rl.megatron.hf_weights import shared_a_module
from moe_rl.megatron.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_tensors, write_adapter

LAYER = "model.layers.1"
R, HIDDEN = 2, 8


def _sent() -> dict[str, torch.Tensor]:
    """A layer's adapters as a sync sends them: the fused QKV's and an expert's gate/up ``A`` once."""
    torch.manual_seed(0)
    out = {}
    for module, fused in (
        ("self_attn.q_proj", ("k_proj", "v_proj")),
        ("mlp.experts.3.gate_proj", ("up_proj",)),
    ):
        out[f"{LAYER}.{module}.lora_A.weight"] = torch.randn(R, HIDDEN)
        parent = module.rsplit(".", 1)[0]
        for name in (module, *(f"{parent}.{f}" for f in fused)):
            out[f"{LAYER}.{name}.lora_B.weight"] = torch.randn(HIDDEN, R)
    for module in ("self_attn.o_proj", "mlp.experts.3.down_proj"):
        out[f"{LAYER}.{module}.lora_A.weight"] = torch.randn(R, HIDDEN)
        out[f"{LAYER}.{module}.lora_B.weight"] = torch.randn(HIDDEN, R)
    return out


def test_each_fused_piece_shares_its_first_linears_a():
    pairs = {
        "self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
        "self_attn.q_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
        "mlp.up_proj": "mlp.gate_proj", "mlp.shared_experts.up_proj": "mlp.shared_experts.gate_proj",
        "mlp.experts.3.up_proj": "mlp.experts.3.gate_proj", "mlp.experts.3.down_proj": "mlp.experts.3.down_proj",
    }  # fmt: skip
    found = {m: shared_a_module(f"{LAYER}.{m}") for m in pairs}
    assert found == {m: f"{LAYER}.{s}" for m, s in pairs.items()}


def test_every_hf_linear_gets_its_b_and_its_fused_linears_a():
    sent = _sent()
    out = peft_tensors(sent.items())
    shared = {  # HF linear -> the one whose A it shares
        "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
        "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
        "mlp.experts.3.gate_proj": "mlp.experts.3.gate_proj", "mlp.experts.3.up_proj": "mlp.experts.3.gate_proj",
        "mlp.experts.3.down_proj": "mlp.experts.3.down_proj",
    }  # fmt: skip
    expected = {}
    for module, a_module in shared.items():
        peft = f"base_model.model.{LAYER}.{module}"
        expected[f"{peft}.lora_A.weight"] = sent[f"{LAYER}.{a_module}.lora_A.weight"]
        expected[f"{peft}.lora_B.weight"] = sent[f"{LAYER}.{module}.lora_B.weight"]
    assert sorted(out) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(out[name], tensor), name
    # copies: the sync's tensors may be reused
    assert all(out[n].data_ptr() != t.data_ptr() for n, t in expected.items())


def test_adapters_that_do_not_pair_up_are_refused():
    sent = _sent()
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj.weight' is not a LoRA adapter"):
        peft_tensors([*sent.items(), (f"{LAYER}.self_attn.o_proj.weight", torch.ones(HIDDEN, HIDDEN))])
    no_a = {n: t for n, t in sent.items() if n != f"{LAYER}.self_attn.q_proj.lora_A.weight"}
    with pytest.raises(
        ValueError, match=r"the adapter of 'model.layers.1.self_attn.q_proj' came without its A"
    ):
        peft_tensors(no_a.items())
    no_b = {n: t for n, t in sent.items() if n != f"{LAYER}.self_attn.o_proj.lora_B.weight"}
    with pytest.raises(ValueError, match=r"adapter A without a B: \['model.layers.1.self_attn.o_proj'\]"):
        peft_tensors(no_b.items())


def test_the_folder_holds_the_tensors_and_the_recipes_rank_and_alpha(tmp_path):
    from safetensors.torch import load_file

    tensors = peft_tensors(_sent().items())
    lora = LoraConfig(rank=R, alpha=16.0, sync="adapters")
    modules = write_adapter(tensors, lora, tmp_path / "adapter", "base-model")
    assert modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (R, 16.0, False)
    assert config["target_modules"] == modules and config["base_model_name_or_path"] == "base-model"
    saved = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert sorted(saved) == sorted(tensors) and all(torch.equal(saved[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match=r"the model has no adapters \(lora.rank is 0\)"):
        write_adapter({}, lora, tmp_path / "none", None)
