"""The PEFT adapter folder of a LoRA model (`moe_rl.megatron.peft_adapter`) from the adapters as a
sync carries them (`hf_weights`: a fused linear's ``A`` once, under its first HF linear): every HF
linear gets its own ``B`` and a copy of that ``A``, the folder's config names the recipe's rank and
alpha. From a tiny LoRA model: each HF linear's ``W + s·B·A`` is the merged weight a sync sends, and
with its adapters dropped the model's HF weights are its base's. vLLM's own reader of adapter
folders judges the config. The folder served by vLLM against the merged model is
`tests/e2e/test_export_to_vllm.py`."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_testing import tiny_recipe

from moe_rl.config.schema import LoraConfig
from moe_rl.megatron.hf_weights import iter_hf_weights, shared_a_module
from moe_rl.megatron.lora import adapted_linears
from moe_rl.megatron.peft_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_config,
    adapter_tensors,
    drop_adapters,
    peft_tensors,
    save_adapter,
    write_adapter,
)
from moe_rl.trainer.worker import TrainerWorker

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
    with pytest.raises(ValueError) as refused:
        peft_tensors(no_a.items())
    assert str(refused.value) == (
        "the adapter of 'model.layers.1.self_attn.q_proj' came without its A "
        "(model.layers.1.self_attn.q_proj.lora_A.weight)"
    )
    no_b = {n: t for n, t in sent.items() if n != f"{LAYER}.self_attn.o_proj.lora_B.weight"}
    with pytest.raises(ValueError, match=r"adapter A without a B: \['model.layers.1.self_attn.o_proj'\]"):
        peft_tensors(no_b.items())
    lone = {f"model.layers.{i}.self_attn.o_proj.lora_A.weight": torch.ones(R, HIDDEN) for i in range(4, 8)}
    with pytest.raises(ValueError) as refused:
        peft_tensors([*sent.items(), *lone.items()])
    assert str(refused.value) == "adapter A without a B: " + str(
        [f"model.layers.{i}.self_attn.o_proj" for i in range(4, 7)]
    )  # the first three of four


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


def test_the_config_is_a_plain_lora_that_vllm_and_peft_read_as_it_was_trained(tmp_path):
    """Every field by hand: PEFT reads ``fan_in_fan_out`` (weights stored ``[in, out]``, GPT-2's
    Conv1D) and DoRA/rsLoRA as other adapters, ``inference_mode`` as frozen. vLLM's reader of
    adapter folders (`PEFTHelper`) takes the folder and finds the recipe's scale."""
    from vllm.config.lora import LoRAConfig as VllmLoraConfig
    from vllm.lora.peft_helper import PEFTHelper

    tensors = peft_tensors(_sent().items())
    lora = LoraConfig(rank=R, alpha=6.0, dropout=0.1, sync="adapters")
    assert adapter_config(lora, tensors, None) == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": R, "lora_alpha": 6.0, "lora_dropout": 0.1,
        "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True,
    }  # fmt: skip
    folder = tmp_path / "exports" / "step_3" / "adapter"  # parents made
    write_adapter(tensors, lora, folder, None)
    write_adapter(tensors, lora, folder, None)  # and written again over an earlier export
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    helper.validate_legal(VllmLoraConfig(max_lora_rank=8))
    assert helper.vllm_lora_scaling_factor == 3.0  # alpha / rank


@pytest.fixture(scope="module")
def lora_model():
    """A tiny LoRA model, rank 2 and alpha 6 (s = 3)."""
    return TrainerWorker(tiny_recipe("lora.rank=2", "lora.alpha=6"))


def test_a_models_adapters_add_s_b_a_to_each_hf_linear_and_dropped_leave_its_base(lora_model, tmp_path):
    """For every HF linear an adapter covers, the merged weight a sync sends is the base weight plus
    ``(alpha / rank)·B·A`` of the folder's tensors; every other HF weight is the base's."""
    from safetensors.torch import load_file

    model = lora_model.model
    torch.manual_seed(5)
    with torch.no_grad():  # every adapter non-zero (a fresh adapter's B is zero)
        for module in adapted_linears(model).values():
            module.lora_b.normal_(0.0, 0.05)
    merged = {n: t.clone() for n, t in iter_hf_weights(model)}
    modules = save_adapter(model, lora_model.config.lora, tmp_path / "adapter", "base")
    tensors = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert tensors.keys() == adapter_tensors(model).keys()
    assert modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    drop_adapters(model)
    assert all(torch.count_nonzero(m.lora_b) == 0 for m in adapted_linears(model).values())
    base = dict(iter_hf_weights(model))
    covered = {n.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight"
               for n in tensors if n.endswith("lora_A.weight")}  # fmt: skip
    layers, experts = lora_model.config.model.num_layers, lora_model.config.model.num_experts
    assert len(covered) == layers * (4 + 3 * experts)  # q, k, v, o; gate, up, down per expert
    for name, weight in merged.items():
        if name not in covered:
            assert torch.equal(weight, base[name]), name
            continue
        peft = PEFT_PREFIX + name.removesuffix(".weight")
        delta = 3.0 * tensors[f"{peft}.lora_B.weight"].float() @ tensors[f"{peft}.lora_A.weight"].float()
        assert delta.abs().max() > 0, name
        torch.testing.assert_close(weight.float(), base[name].float() + delta, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field", ["tensor", "pipeline", "expert"])
def test_only_a_model_held_whole_by_one_rank_is_exported(lora_model, field):
    config = lora_model.model.config
    attribute = f"{field}_model_parallel_size"
    before = getattr(config, attribute)
    setattr(config, attribute, 2)
    try:
        with pytest.raises(ValueError, match=r"held whole by one rank \(TP = PP = EP = 1\)"):
            adapter_tensors(lora_model.model)
    finally:
        setattr(config, attribute, before)
