"""The weight-sync plan: what moves from the trainer to the engines at every sync and by which
route, decided once from the recipe and the device it runs on, before anything starts. The trainer
ranks, the engines and `moe-rl plan` read it here; nothing decides it again during a run.

What moves (`SyncPlan.wire`):

* buckets of about ``rollout.sync_bucket_mb`` of Hugging Face-named tensors; quantized on the
  sending side by the rollout recipe (``fp8`` / ``int8`` data and fp32 scales) when the engine takes
  quantized bytes (the Megatron engine), else the tensors as the trainer holds them (vLLM quantizes
  them itself);
* or the whole model in the engine's dtype, through vLLM's own weight-transfer API;
* of a LoRA run with ``lora.sync=adapters`` (`SyncPlan.adapters`), the frozen base weights as they
  are and the adapters beside them (the Megatron engines apply them; vLLM engines load them through
  vLLM's own LoRA, as buckets), then, once an engine holds that, only what trains: the adapters
  (and, into Megatron engines, a router or output layer trained whole).

The routes (`SyncRoute`; ``rollout.sync_transport`` picks one where a user has reason to):

* ``buckets``: each trainer rank sends the tensors it owns to every engine, through shared memory to
  the engines on its node and in a process group of its own to the engines on other nodes;
* ``device_ipc``: each trainer rank sends the whole model, in buckets in its GPU's memory, to the
  Megatron engines that share its GPU (colocated), which read them there by CUDA IPC handle;
* ``vllm_nccl``: trainer rank 0 sends the whole model to vLLM engines on nodes of their own by vLLM's
  NCCL weight transfer;
* ``vllm_ipc``: every trainer rank shares the whole model from its GPU with the vLLM engines on the
  trainer's GPUs by vLLM's CUDA IPC weight transfer;
* ``in_process``: the one-process loop: the engine takes each bucket in the trainer's process.

The mismatch probe's reference model (a Megatron model in the engine's process) takes full-precision
buckets: by the device route when the engine's is ``device_ipc``, else by ``buckets`` (`route_for`).
Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.derived import PlacementMode, placement_mode, releases_memory
from moe_rl.config.modes import Engine, LoraSync, QuantMethod, SyncRoute
from moe_rl.config.schema import RecipeConfig
from moe_rl.rules import Rule

WIRE_METHODS = (QuantMethod.FP8, QuantMethod.INT8)
"""Recipes whose quantized bytes travel (to an engine that takes them); the others send the tensor
itself and leave quantization to the receiver."""


class Senders:
    """Which trainer ranks send what (`SyncPlan.senders`)."""

    OWNERS = "each trainer rank sends the tensors it owns"
    EVERY_RANK = "every trainer rank sends the whole model"
    RANK0 = "trainer rank 0 sends the whole model"


@dataclass(frozen=True)
class SyncPlan:
    """How every weight sync of a run moves the weights (see the module docstring)."""

    route: SyncRoute
    """How the engines' weights travel."""
    quantized_wire: bool
    """Buckets carry the rollout recipe's quantized bytes (the engine decodes them)."""
    wire: str
    """What travels, in words: the recipe's name, or the dtype the tensors keep."""
    bucket_bytes: int
    """Bytes of a bucket (of vLLM's packed buffer on the vLLM routes)."""
    chosen_by: str
    """Why this route: ``rollout.sync_transport=<value>`` or what the automatic choice saw."""
    adapters: bool = False
    """LoRA's adapters travel apart from the base, which an engine takes once (``lora.sync=adapters``);
    the probe's reference model still takes the merged weights."""

    @property
    def senders(self) -> str:
        return {
            SyncRoute.DEVICE_IPC: Senders.EVERY_RANK,
            SyncRoute.VLLM_IPC: Senders.EVERY_RANK,
            SyncRoute.VLLM_NCCL: Senders.RANK0,
        }.get(self.route, Senders.OWNERS)

    @property
    def same_device(self) -> bool:
        """Each trainer rank streams to the engines on its own GPU only (the device route)."""
        return self.route == SyncRoute.DEVICE_IPC

    @property
    def every_rank(self) -> bool:
        """Every rank sends the whole model (tensor- and expert-parallel shards gathered first)."""
        return self.senders == Senders.EVERY_RANK

    @property
    def vllm_transfer(self) -> bool:
        """The engines take the weights through vLLM's weight-transfer API, not as buckets."""
        return self.route in (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC)

    def route_for(self, reference: bool) -> SyncRoute:
        """The route of a sync into the engines (``reference`` False) or into the probe's
        full-precision reference model beside one (``reference`` True: buckets, on the device when
        the engines' route is the device one)."""
        if not reference or self.route in (SyncRoute.DEVICE_IPC, SyncRoute.IN_PROCESS):
            return self.route
        return SyncRoute.BUCKETS

    def describe(self) -> str:
        """One line: the route, what travels and who sends it."""
        mib = self.bucket_bytes / (1 << 20)
        unit = "vLLM's packed buffers" if self.vllm_transfer else "buckets"
        adapters = "; LoRA adapters apart, only what trains once an engine holds the base" * self.adapters
        return (
            f"{self.route} ({ROUTE_WORDS[self.route]}); {self.wire} in {unit} of {mib:g} MiB; "
            f"{self.senders}{adapters}; chosen by {self.chosen_by}"
        )


ROUTE_WORDS = {
    SyncRoute.BUCKETS: "shared memory on a sender's node, a process group to other nodes",
    SyncRoute.DEVICE_IPC: "buckets in each trainer GPU's memory, read by the engine on that GPU",
    SyncRoute.VLLM_NCCL: "vLLM's NCCL weight transfer from trainer rank 0",
    SyncRoute.VLLM_IPC: "vLLM's CUDA IPC weight transfer from every trainer GPU",
    SyncRoute.IN_PROCESS: "the engine takes each bucket in the trainer's process",
}


def _automatic(config: RecipeConfig, device: str) -> tuple[SyncRoute, str]:
    """The route a recipe gets when ``rollout.sync_transport`` is ``auto``, and why."""
    engine, colocated = config.rollout.engine, placement_mode(config) == PlacementMode.COLOCATED
    one_stage = config.parallel.pipeline_model_parallel_size == 1
    where = "colocated" if colocated else "on nodes of their own"
    if engine == Engine.VLLM and sends_adapters(config):
        return SyncRoute.BUCKETS, f"auto: LoRA adapters into vllm engines' own LoRA, {where}"
    if device == "cuda" and one_stage and engine == Engine.VLLM:
        route = SyncRoute.VLLM_IPC if colocated else SyncRoute.VLLM_NCCL
        return route, f"auto: vllm engines on cuda, {where}, one pipeline stage"
    if device == "cuda" and one_stage and engine == Engine.MEGATRON and colocated:
        return SyncRoute.DEVICE_IPC, "auto: megatron engines on cuda, colocated, one pipeline stage"
    return SyncRoute.BUCKETS, f"auto: {engine} engines on {device}, {where}"


def sync_plan(config: RecipeConfig, device: str, in_process: bool = False) -> SyncPlan:
    """The `SyncPlan` of ``config`` on ``device`` (``cpu`` / ``cuda``); ``in_process``: the one-process
    loop. Raises ``ValueError`` naming the key for a route that cannot work (`sync_rules`)."""
    broken = next((rule for rule in sync_rules(config, device, in_process) if rule.broken), None)
    if broken is not None:
        raise ValueError(broken.detail)
    chosen = config.rollout.sync_transport
    if in_process:
        route, why = SyncRoute.IN_PROCESS, "the one-process loop"
    elif chosen == SyncRoute.AUTO:
        route, why = _automatic(config, device)
    else:
        route, why = chosen, f"rollout.sync_transport={chosen}"
    quant = config.quant
    quantized = (
        config.rollout.engine == Engine.MEGATRON
        and quant.method in WIRE_METHODS
        and route not in (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC)
    )
    if quantized:
        wire = f"{quant.name} on the wire"
    elif route in (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC):
        wire = "the whole model in the engines' dtype"
    else:
        wire = "tensors as the trainer holds them"
    return SyncPlan(route, quantized, wire, config.rollout.sync_bucket_mb << 20, why, sends_adapters(config))


def sends_adapters(config: RecipeConfig) -> bool:
    """Whether the syncs carry LoRA's adapters apart (`SyncPlan.adapters`): the trainer sends them so,
    the Megatron engines build their model with the adapters to take them, vLLM engines start with
    vLLM's LoRA enabled and load each sync's adapters as a LoRA request."""
    return config.lora.rank > 0 and config.lora.sync == LoraSync.ADAPTERS


def sync_rules(config: RecipeConfig, device: str, in_process: bool = False) -> list[Rule]:
    """``rollout.sync_transport`` against the engine, the device, the placement and the pipeline:
    a route the recipe's layout cannot use is refused, naming what it needs."""
    chosen = config.rollout.sync_transport
    key = f"rollout.sync_transport={chosen}"
    engine, stages = config.rollout.engine, config.parallel.pipeline_model_parallel_size
    colocated = placement_mode(config) == PlacementMode.COLOCATED
    needs = {  # the engine and the placement each GPU route is for
        SyncRoute.DEVICE_IPC: (Engine.MEGATRON, True),
        SyncRoute.VLLM_IPC: (Engine.VLLM, True),
        SyncRoute.VLLM_NCCL: (Engine.VLLM, False),
    }
    gpu_route = chosen in needs
    wanted_engine, wanted_colocated = needs.get(chosen, (engine, colocated))
    where = "on the trainer's GPUs (cluster.rollout_nodes=0)" if wanted_colocated else "on nodes of their own"
    instead = "use rollout.sync_transport=auto or buckets"
    return [
        *_adapter_rules(config, device),
        Rule("sync route chosen by the loop", chosen != SyncRoute.IN_PROCESS or in_process, key,
             advice="the one-process loop's own route; a recipe chooses auto, buckets, device_ipc, vllm_nccl "
             "or vllm_ipc"),
        Rule("sync route in the one-process loop", not in_process or chosen in (SyncRoute.AUTO, SyncRoute.BUCKETS),
             key, advice=f"the one-process loop hands the engine each bucket in its own process; {instead}"),
        Rule("sync route on the recipe's engine", not gpu_route or wanted_engine == engine,
             f"{key}, rollout.engine={engine}", advice=f"the route is for rollout.engine={wanted_engine}; {instead}"),
        Rule("sync route on CUDA", not gpu_route or device == "cuda", f"{key} on {device}",
             advice=f"the route moves weights between GPUs; {instead}"),
        Rule("sync route and placement", not gpu_route or wanted_colocated == colocated,
             f"{key}, cluster.rollout_nodes={config.cluster.rollout_nodes}",
             advice=f"the route needs the engines {where}; {instead}"),
        Rule("sync route with one pipeline stage", not gpu_route or stages == 1,
             f"{key}, parallel.pipeline_model_parallel_size={stages}",
             advice=f"the route sends the whole model from a rank, which needs one pipeline stage; {instead}"),
    ]  # fmt: skip


def _adapter_rules(config: RecipeConfig, device: str) -> list[Rule]:
    """``lora.sync=adapters``: engines that keep the base between syncs, a recipe that quantizes
    weights as they arrive, and for vLLM engines (which load the adapters through vLLM's own LoRA,
    `moe_rl.rollout.vllm_engine`) the adapters as buckets and nothing else trained."""
    lora = config.lora
    if not sends_adapters(config):  # (lora.sync with lora.rank=0 is the recipe's own error)
        return []
    key = f"lora.sync={lora.sync}"
    merged = f"use lora.sync={LoraSync.MERGED}"
    drops = releases_memory(config, device) and config.cluster.engine_sleep_level == 2
    vllm = config.rollout.engine == Engine.VLLM
    transport = config.rollout.sync_transport
    whole = [f"lora.{name}=true" for name in ("train_router", "train_output_layer") if getattr(lora, name)]
    return [
        Rule("LoRA adapter sync keeps the base", not drops,
             f"{key} with cluster.engine_sleep_level=2",
             advice="a level-2 sleep drops the engines' weights, base included, before every sync; set "
             f"cluster.engine_sleep_level=1 or {merged}"),
        Rule("LoRA adapter sync and the quantization recipe", config.quant.method != QuantMethod.INT4_AWQ,
             f"{key} with rollout.quant={config.rollout.quant}",
             advice=f"AWQ calibrates the weights the engine computes with, merged; {merged}"),
        Rule("LoRA adapters into vLLM as buckets",
             not vllm or transport not in (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC),
             f"{key} with rollout.engine=vllm, rollout.sync_transport={transport}",
             advice="vLLM's weight transfer loads the model's own weights, not adapters; the adapters go to "
             f"vLLM's LoRA as buckets: use rollout.sync_transport=auto or buckets, or {merged}"),
        Rule("LoRA adapters into vLLM, nothing trained whole", not vllm or not whole,
             f"{key} with rollout.engine=vllm, {', '.join(whole)}",
             advice="vLLM's LoRA takes adapters only, and a weight trained whole would reload its whole layer "
             f"at every sync; set {' and '.join(w.replace('=true', '=false') for w in whole)}, or {merged}"),
    ]  # fmt: skip
