"""A vLLM engine's settings (`VllmSettings`): a recipe's, by the run's plan (`recipe_settings`), the ``vllm.LLM``
keyword arguments they become (`llm_kwargs`), the process environment the engine starts in
(`engine_env`) and the ``VllmConfig`` vLLM builds and validates from them (`engine_config`, what the
contract tests hand to vLLM's own checks on CPU). Imports vLLM only when a configuration is built."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_rl.config.derived import routing_trace_bytes
from moe_rl.config.modes import Engine, LoraTarget, SyncRoute
from moe_rl.config.run_plan import RunPlan
from moe_rl.config.schema import LoraConfig, QuantConfig, RecipeConfig
from moe_rl.rollout.capabilities import vllm_lora_rank, vllm_quantization
from moe_rl.rollout.engine import EngineCapabilities

WORKER_EXTENSION = "moe_rl.rollout.vllm_worker.WeightSyncExtension"
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class VllmSettings:
    """What a `VLLMEngine` starts vLLM with, but the model (`llm_kwargs` renders them as ``vllm.LLM``
    keyword arguments). ``device`` None: this machine's (CUDA when it has one); ``dtype`` None: the
    device's (float32 on the CPU, bf16 on CUDA); ``routing_store_bytes``: the size of vLLM's store of
    routed experts (None: vLLM sizes it from the KV cache); ``sync_route``: how the engine takes its
    weights, the run's `moe_rl.config.sync_plan.SyncPlan.route`; ``sleep_mode``: vLLM's sleep mode,
    where colocated phases release memory; ``lora``: the run's adapters, sent apart from the base
    (``lora.sync=adapters``), which the engine loads through vLLM's own LoRA; ``engine_kwargs``:
    further ``vllm.LLM`` arguments, over the others."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.2
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    return_routing: bool = False
    return_sampling_mask: bool = False
    enable_prefix_caching: bool = False
    routing_store_bytes: int | None = None
    sync_route: SyncRoute = SyncRoute.BUCKETS
    sleep_mode: bool = False
    lora: LoraConfig | None = None
    engine_kwargs: dict[str, Any] | None = None

    def resolved(self) -> VllmSettings:
        """These settings with the device and dtype told (see the class docstring)."""
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype or ("float32" if device == "cpu" else "bfloat16")
        return dataclasses.replace(self, device=device, dtype=dtype)


def recipe_settings(config: RecipeConfig, caps: EngineCapabilities, plan: RunPlan) -> VllmSettings:
    """The `VLLMEngine` settings of a recipe on an engine of ``caps`` (everything but the model), by
    the run's ``plan``: its sync route, and vLLM's sleep mode where colocated phases release memory."""
    if config.rollout.engine != Engine.VLLM:
        raise ValueError(f"rollout.engine='{config.rollout.engine}': VLLMEngine serves rollout.engine=vllm")
    r = config.rollout
    routing = r.return_routing and caps.routing
    return VllmSettings(
        quant=config.quant,
        device=caps.device,
        seed=config.run.seed,
        max_model_len=r.max_model_len,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
        tensor_parallel_size=r.tensor_parallel_size,
        return_routing=routing,
        return_sampling_mask=r.return_sampling_mask and caps.sampling_mask,
        enable_prefix_caching=config.env.name is not None,
        # the routed experts of this engine's share of a rollout batch (prompts are spread over engines)
        routing_store_bytes=-(-routing_trace_bytes(config) // r.num_engines) if routing else None,
        sync_route=plan.sync.route,
        sleep_mode=plan.releases_memory,
        lora=config.lora if plan.sync.adapters else None,
    )


ROUTING_STORE_MIN_BYTES = 16 << 20
"""The smallest routed-experts store the engine asks vLLM for (a tiny model's batch needs little)."""


def llm_kwargs(model_path: str | Path, settings: VllmSettings | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of an engine: what `VLLMEngine` starts vLLM with, and what
    the contract tests hand to vLLM's own configuration checks (`engine_config`).

    On CUDA: vLLM's weight-transfer backend of the run's ``sync_route`` (NCCL for ``vllm_nccl``, IPC
    otherwise: `moe_rl.config.sync_plan`); vLLM's sleep mode when
    colocated phases give memory back (``sleep_mode``, `config.derived.releases_memory`); online
    quantization of the recipe (`capabilities.vllm_quantization`); sampling masks when asked; and routed experts (R3) as
    vLLM's auxiliary output, which requires prefix caching (`VllmConfig._verify_aux_output_
    compatibility`): it is turned on, so a cached prefix still returns its routing from the store,
    whose size (``aux_output_config.max_bytes``) is ``routing_store_bytes`` (at least
    `ROUTING_STORE_MIN_BYTES`). The prefix cache is emptied at every weight update. Settings vLLM
    cannot combine with routing capture (pipeline-parallel engines, speculative decoding) are
    refused here, naming why. With ``lora`` (adapters sent apart), vLLM's LoRA is on, one adapter at
    a time, of the smallest ``max_lora_rank`` that holds the run's rank (`capabilities.vllm_lora_rank`),
    on the modules of the run's targets (`vllm_lora_modules`)."""
    s = (settings or VllmSettings()).resolved()
    extra = dict(s.engine_kwargs or {})
    prefix_caching = s.enable_prefix_caching
    cuda: dict[str, Any] = {}
    if s.device == "cuda":
        backend = "nccl" if s.sync_route == SyncRoute.VLLM_NCCL else "ipc"
        cuda["weight_transfer_config"] = {"backend": backend}
        if s.sleep_mode:
            cuda["enable_sleep_mode"] = True
        if s.return_routing:
            cuda["enable_return_routed_experts"] = True
            prefix_caching = True  # vLLM keeps the routing of cached prefixes only with it
            if s.routing_store_bytes is not None:
                cuda["aux_output_config"] = {
                    "max_bytes": max(int(s.routing_store_bytes), ROUTING_STORE_MIN_BYTES)
                }
            _check_routing_capture(extra)
        if s.return_sampling_mask:
            cuda["return_sampling_mask"] = True
        quantization = vllm_quantization(s.quant)
        if quantization is not None:
            cuda["quantization"] = quantization
    adapters: dict[str, Any] = {}
    lora = s.lora
    if lora is not None:
        adapters = {
            "enable_lora": True,
            "max_lora_rank": vllm_lora_rank(lora.rank),
            "max_loras": 1,
            "lora_target_modules": vllm_lora_modules(lora),
        }
    return {
        "model": str(model_path),
        "skip_tokenizer_init": True,
        "dtype": s.dtype,
        "seed": s.seed,
        "max_model_len": s.max_model_len,
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "enforce_eager": s.enforce_eager,
        "tensor_parallel_size": s.tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        # Multi-turn rollouts send each turn's whole context again: cached prefix blocks save
        # recomputing it; R3 needs it on CUDA. Off otherwise (explicitly: vLLM's own default is on
        # for GPUs). The cache is emptied at every weight update (`VLLMEngine._weights_changed`).
        "enable_prefix_caching": prefix_caching,
        "worker_extension_cls": WORKER_EXTENSION,
        "disable_log_stats": True,
        **cuda,
        **adapters,
        **extra,
    }


VLLM_LORA_MODULES: dict[LoraTarget, tuple[str, ...]] = {
    LoraTarget.ATTENTION: ("qkv_proj", "o_proj"),
    LoraTarget.DENSE_MLP: ("gate_up_proj", "down_proj"),
    LoraTarget.EXPERTS: ("experts",),
    LoraTarget.SHARED_EXPERTS: ("gate_up_proj", "down_proj"),
}
"""The names (last parts) of vLLM's modules that carry each ``lora.targets`` kind, as vLLM's
``lora_target_modules`` matches them: its fused attention and MLP linears and its fused MoE. Dense
MLPs and shared experts share names there, so either kind wraps both; a wrapped module the adapter
does not cover computes no LoRA term. (An adapter on a module vLLM did not wrap would be dropped
without a word: `tests/e2e/test_vllm_lora.py` reads back every adapted linear.)"""


def vllm_lora_modules(lora: LoraConfig) -> list[str]:
    """vLLM's ``lora_target_modules`` for the run's targets (`VLLM_LORA_MODULES`): vLLM wraps only
    those, not the embedding, the routers or the head it would wrap otherwise."""
    return sorted({name for target in lora.targets for name in VLLM_LORA_MODULES[LoraTarget(target)]})


def _check_routing_capture(extra: dict[str, Any]) -> None:
    """What vLLM cannot capture routed experts with, refused before it starts."""
    pp = int(extra.get("pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ValueError(
            f"vLLM pipeline_parallel_size={pp} with routed experts (R3): vLLM returns routed experts only "
            "without pipeline parallelism; use tensor parallelism (rollout.tensor_parallel_size) or "
            "algo.routing_replay=r2 / off"
        )
    if extra.get("speculative_config"):
        raise ValueError(
            "vLLM speculative decoding with routed experts (R3): the routing of draft tokens is not the "
            "policy's; drop speculative_config or use algo.routing_replay=r2 / off"
        )
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(extra.get(key, 1) or 1) > 1:
            raise ValueError(
                f"vLLM {key}={extra[key]} with routed experts (R3): vLLM refuses context parallelism there"
            )


@contextlib.contextmanager
def engine_env(in_process: bool, v2_runner: bool) -> Iterator[None]:
    """The process environment a vLLM engine starts in (Model Runner V2 for routed experts and
    sampling masks; vLLM's own processes or this one), restored afterwards."""
    env = {_MP_ENV: "0" if in_process else "1"}
    if v2_runner:
        env[_V2_RUNNER_ENV] = "1"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import vllm.envs

        vllm.envs.disable_envs_cache()  # an engine started earlier in this process cached the old values
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def engine_config(kwargs: dict[str, Any]) -> Any:
    """The ``VllmConfig`` vLLM builds and validates from ``kwargs`` (what ``vllm.LLM(**kwargs)``
    checks before it starts anything), in the environment the engine would start in."""
    from vllm.engine.arg_utils import EngineArgs

    v2 = bool(kwargs.get("enable_return_routed_experts") or kwargs.get("return_sampling_mask"))
    with engine_env(in_process=False, v2_runner=v2):
        return EngineArgs(**kwargs).create_engine_config()
