"""Capability checks before launch: each refusal names the engine, the feature and alternatives."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from moe_rl.config.schema import QuantConfig, RecipeConfig
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.capabilities import (
    VLLM_CPU_HEAD_SIZES,
    VLLM_LORA_RANKS,
    Machine,
    check_recipe,
    engine_capabilities,
    resolve_device,
    vllm_lora_rank,
    vllm_quantization,
)

CPU = Machine(cuda=False)
H100 = Machine(cuda=True, capability=(9, 0))
B200 = Machine(cuda=True, capability=(10, 0))
REPO = Path(__file__).resolve().parents[3]

QUANTS = {
    "bf16": QuantConfig(name="bf16", method="none"),
    "fp8_block128": QuantConfig(name="fp8_block128", method="fp8", granularity="block", block_size=128),
    "fp8_tensor": QuantConfig(name="fp8_tensor", method="fp8", granularity="tensor", weight_only=False),
    "int8": QuantConfig(name="int8", method="int8", granularity="channel"),
    "int4_awq": QuantConfig(name="int4_awq", method="int4_awq", granularity="block"),
    "nvfp4": QuantConfig(
        name="nvfp4", method="nvfp4", granularity="block", block_size=16, requires_cuda=True
    ),
}


def recipe(engine: str = "vllm", device: str = "auto", quant: str = "bf16", **algo) -> RecipeConfig:
    config = RecipeConfig()
    config.run.device = device
    config.rollout.engine = engine
    config.rollout.quant = quant
    config.quant = QUANTS[quant]
    config.model.head_dim = 32
    config.rollout.return_routing = False
    config.rollout.return_sampling_mask = False
    config.algo.routing_replay = algo.get("routing_replay", "off")
    config.algo.corrections.keep_sampling_mask = algo.get("ksm", False)
    return config


def test_vllm_cpu_refuses_r3_naming_engine_feature_and_alternatives():
    with pytest.raises(ValueError) as err:
        check_recipe(recipe(routing_replay="r3"), CPU)
    message = str(err.value)
    assert "rollout.engine=vllm on cpu (the vllm-cpu build)" in message
    assert "routed experts" in message and "algo.routing_replay=r3" in message
    assert "rollout.engine=megatron (on cpu)" in message and "a CUDA GPU" in message


def test_vllm_cpu_refuses_keep_sampling_mask():
    with pytest.raises(ValueError, match=r"vllm-cpu build\) cannot return sampling masks.*megatron"):
        check_recipe(recipe(ksm=True), CPU)


@pytest.mark.parametrize("quant", ["fp8_block128", "fp8_tensor", "int8", "int4_awq"])
def test_vllm_cpu_refuses_every_quantized_recipe(quant: str):
    with pytest.raises(
        ValueError, match=rf"vllm-cpu build\) cannot run rollout.quant={quant}.*megatron on cpu"
    ):
        check_recipe(recipe(quant=quant), CPU)


@pytest.mark.parametrize("engine", ["vllm", "megatron"])
def test_nvfp4_without_cuda_is_refused_for_every_engine(engine: str):
    with pytest.raises(ValueError, match=r"nvfp4\).*needs a CUDA GPU.*fp8_block128"):
        check_recipe(recipe(engine=engine, quant="nvfp4"), CPU)


def test_nvfp4_on_vllm_needs_blackwell():
    with pytest.raises(ValueError, match=r"compute capability \(9, 0\).*Blackwell.*megatron"):
        check_recipe(recipe(quant="nvfp4"), H100)
    assert check_recipe(recipe(quant="nvfp4"), B200).nvfp4


@pytest.mark.parametrize("quant", ["int8", "int4_awq"])
def test_vllm_cuda_refuses_recipes_without_online_quantization(quant: str):
    with pytest.raises(
        ValueError, match=rf"cannot run rollout.quant={quant}.*rollout.engine=megatron on cuda"
    ):
        check_recipe(recipe(quant=quant), H100)


def test_vllm_cuda_gives_routing_masks_and_fp8():
    caps = check_recipe(recipe(quant="fp8_block128", routing_replay="r3", ksm=True), H100)
    assert (caps.engine, caps.device, caps.routing, caps.sampling_mask, caps.fp8) == (
        "vllm",
        "cuda",
        True,
        True,
        True,
    )
    assert caps.weight_transfer == "ipc" and not caps.fake_quant


@pytest.mark.parametrize("quant", ["bf16", "fp8_block128", "fp8_tensor", "int8", "int4_awq"])
def test_megatron_on_cpu_runs_r3_ksm_and_fake_quant(quant: str):
    caps = check_recipe(recipe(engine="megatron", quant=quant, routing_replay="r3", ksm=True), CPU)
    assert caps.routing and caps.sampling_mask and caps.fake_quant and caps.device == "cpu"


def test_run_device_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="run.device=cuda but this machine has no CUDA device"):
        check_recipe(recipe(device="cuda"), CPU)
    assert resolve_device("auto", CPU) == "cpu" and resolve_device("auto", H100) == "cuda"
    assert resolve_device("cpu", H100) == "cpu"


def test_vllm_cpu_refuses_head_sizes_its_attention_backend_lacks():
    config = recipe()
    config.model.head_dim = 16
    with pytest.raises(ValueError, match=re.escape("model.head_dim=16 is not supported by vllm-cpu")):
        check_recipe(config, CPU)
    for head_dim in VLLM_CPU_HEAD_SIZES:
        config.model.head_dim = head_dim
        check_recipe(config, CPU)


@pytest.mark.parametrize("machine", [CPU, H100])
def test_vllm_context_must_hold_the_longest_sequence(machine: Machine):
    config = recipe()
    config.rollout.max_model_len = config.data.max_prompt_len + config.rollout.max_new_tokens
    check_recipe(config, machine)
    config.rollout.max_model_len -= 1
    with pytest.raises(
        ValueError,
        match=r"data.max_prompt_len \+ rollout.max_new_tokens = 80 exceeds rollout.max_model_len=79",
    ):
        check_recipe(config, machine)
    config.env.name, config.rollout.max_model_len = (
        "calculator",
        200,
    )  # multi-turn: the response budget counts
    config.env.max_tokens = 200 - config.data.max_prompt_len + 1
    with pytest.raises(ValueError, match="data.max_prompt_len \\+ env.max_tokens = 201 exceeds"):
        check_recipe(config, machine)
    config.rollout.engine = "megatron"  # its context is the model's, checked with the recipe
    check_recipe(config, machine)


def test_return_requests_an_engine_cannot_serve_are_logged_not_fatal(caplog: pytest.LogCaptureFixture):
    config = recipe()
    config.rollout.return_routing = True
    config.rollout.return_sampling_mask = True
    with caplog.at_level(logging.WARNING, logger="moe_rl.rollout.capabilities"):
        caps = check_recipe(config, CPU)
    assert not caps.routing
    assert "rollout.return_routing=true is ignored" in caplog.text
    assert "rollout.return_sampling_mask=true is ignored" in caplog.text


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="rollout.engine='sglang' on device 'cpu': unknown"):
        engine_capabilities("sglang", "cpu")


@pytest.mark.parametrize(
    ("quant", "expected"),
    [
        ("bf16", None),
        ("fp8_block128", "fp8_per_block"),
        ("fp8_tensor", "fp8_per_tensor"),
        ("nvfp4", "nvfp4_per_token"),
    ],
)
def test_vllm_online_quantization_names(quant: str, expected: str | None):
    assert vllm_quantization(QUANTS[quant]) == expected


def test_vllm_block_fp8_needs_128_blocks():
    with pytest.raises(ValueError, match="quant.block_size=64"):
        vllm_quantization(QuantConfig(name="fp8_block64", method="fp8", granularity="block", block_size=64))


def test_shipped_tiny_recipe_passes_on_cpu():
    config = load_checked(REPO / "recipes" / "tiny_moe.yaml")
    caps = check_recipe(config, CPU)
    assert caps.engine == config.rollout.engine


def _adapters(config: RecipeConfig, rank: int = 8) -> RecipeConfig:
    config.lora.rank, config.lora.sync = rank, "adapters"
    return config


def test_adapters_into_vllm_need_its_cuda_build_a_gqa_model_and_a_rank_it_holds():
    """``lora.sync=adapters``: vLLM's CPU build has no LoRA kernel for fused-MoE layers; vLLM's
    DeepSeek loader cannot reload a LoRA-wrapped layer's base; vLLM's LoRA holds ranks to 512."""
    with pytest.raises(ValueError) as err:
        check_recipe(_adapters(recipe()), CPU)
    message = str(err.value)
    assert (
        "rollout.engine=vllm on cpu (the vllm-cpu build) has no LoRA kernel for fused-MoE layers" in message
    )
    assert "rollout.engine=megatron (on cpu)" in message and "a CUDA GPU" in message
    assert "lora.sync=merged" in message
    assert check_recipe(_adapters(recipe(device="cuda")), H100).adapters
    assert check_recipe(_adapters(recipe(engine="megatron")), CPU).adapters
    mla = _adapters(recipe(device="cuda"))
    mla.model.attention = "mla"
    with pytest.raises(ValueError, match=r"model.attention=mla: vLLM's DeepSeek weight loader cannot reload"):
        check_recipe(mla, H100)
    mla.lora.sync = "merged"  # the merged weights load as any sync does
    check_recipe(mla, H100)
    with pytest.raises(ValueError, match=r"lora.rank=513 .* vLLM's LoRA holds ranks up to 512"):
        check_recipe(_adapters(recipe(device="cuda"), rank=513), H100)
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 321, 512)] == [1, 8, 8, 16, 320, 512, 512]


def test_the_lora_ranks_are_vllms_own():
    vllm_lora = pytest.importorskip("vllm.config.lora")
    import typing

    assert typing.get_args(vllm_lora.MaxLoRARanks) == VLLM_LORA_RANKS
