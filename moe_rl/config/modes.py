"""The modes a recipe chooses among, typed: one `StrEnum` per choice field, its values the
recipe's spelling, its names those values in capitals. The loader (`moe_rl.config.loader`) turns
the YAML strings into members, naming the field and the valid values when a string is none of
them; code compares members (``config.run.mode == RunMode.ASYNC``), never strings.

The algorithm's choices live with the math (`moe_rl.algo.modes`), the device's with the device
(`moe_rl.device.RunDevice`). Which fields are choices is read from the schema's field types
(`choice_fields`; the recipe's table is `moe_rl.config.schema.CHOICES`), so no list of them can
miss one. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum, StrEnum
from typing import Any


class TaskKind(StrEnum):
    """Where ``data.task``'s prompts come from: a task made locally, or a dataset file."""

    SYNTHETIC = "synthetic"
    FILE = "file"


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """``data.task`` read once (`DataConfig.source`): its kind and the synthetic task's name or the
    dataset file's path, as the recipe spells them."""

    kind: TaskKind
    name: str

    @classmethod
    def parse(cls, text: str) -> TaskSource:
        """``synthetic:<task>`` or ``file:<path>``; anything else is a `ConfigError` naming the value."""
        from moe_rl.errors import ConfigError, brief

        kind, sep, name = text.partition(":")
        if not sep or not name or kind not in TaskKind.__members__.values():
            raise ConfigError(f"data.task={brief(text)}: expected `synthetic:<task>` or `file:<path>`")
        return cls(TaskKind(kind), name)

    @property
    def is_file(self) -> bool:
        return self.kind == TaskKind.FILE

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


class CriticInit(StrEnum):
    """``critic.init``: where the critic's body starts."""

    POLICY = "policy"
    CONFIG = "config"
    CHECKPOINT = "checkpoint"


class LoraTarget(StrEnum):
    """``lora.targets``: the linear layers that carry adapters."""

    ATTENTION = "attention"
    """The attention projections: GQA's QKV and output; MLA's query (or query-up), key-value-up and
    output projections (not its down projections to the latents: Megatron's MLA builds those only
    as its own classes)."""
    DENSE_MLP = "dense_mlp"
    """The feed-forward of the dense layers."""
    EXPERTS = "experts"
    """Every routed expert's two linears (an adapter per expert)."""
    SHARED_EXPERTS = "shared_experts"
    """The shared experts' linears."""


class LoraInit(StrEnum):
    """``lora.init``: how ``A`` starts (``B`` starts at zero, so a fresh adapter changes nothing)."""

    KAIMING = "kaiming"
    """Kaiming-uniform over the input features (the usual LoRA start)."""
    GAUSSIAN = "gaussian"
    """Normal with standard deviation 1/rank."""


class LoraSync(StrEnum):
    """``lora.sync``: what a LoRA run's weight syncs carry to the engines."""

    MERGED = "merged"
    """The merged model, every sync (each adapter added into its weight): engines see an ordinary model."""
    ADAPTERS = "adapters"
    """The Megatron engines hold the adapters themselves: the first sync into an engine (and the one
    after it restarts) carries the frozen base and the adapters, every later one only what trains."""


class LoraExport(StrEnum):
    """``moe-rl export --lora``: what a LoRA run's export writes."""

    MERGED = "merged"
    """The model as it computes: each adapter merged into its weight (a Hugging Face folder)."""
    ADAPTER = "adapter"
    """The adapters alone, as a PEFT-style adapter folder over the base's Hugging Face names."""
    BASE = "base"
    """The frozen base weights the adapters apply to (a Hugging Face folder)."""


class RunMode(StrEnum):
    """``run.mode``: on-policy, one-step-off-policy, or offline (DGO)."""

    SYNC = "sync"
    ASYNC = "async"
    OFFLINE = "offline"


class Family(StrEnum):
    """``model.family``: the Hugging Face architecture the model maps to."""

    QWEN3_MOE = "qwen3_moe"
    DEEPSEEK_V3 = "deepseek_v3"


class Attention(StrEnum):
    """``model.attention``: grouped-query or multi-latent attention."""

    GQA = "gqa"
    MLA = "mla"


class ScoreFunction(StrEnum):
    """``model.moe_router_score_function``."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class RopeScaling(StrEnum):
    """``model.rope_scaling_type``."""

    NONE = "none"
    YARN = "yarn"


class Engine(StrEnum):
    """``rollout.engine``: the rollout engine."""

    MEGATRON = "megatron"
    VLLM = "vllm"


class GpuType(StrEnum):
    """The chip of the cluster's nodes (``cluster.gpu_type``): what `moe-rl plan`'s step time reads
    peak FLOP/s, memory and link bandwidths of (`moe_rl.planner.step_time.MACHINES`)."""

    AUTO = "auto"
    """``cpu`` without GPUs (``cluster.gpus_per_node`` 0), else the GPU whose memory is
    ``cluster.gpu_memory_gib`` (80: h100, 140 or 141: h200, 180: b200, 186: gb200)."""
    H100 = "h100"
    H200 = "h200"
    B200 = "b200"
    GB200 = "gb200"
    CPU = "cpu"
    """A CPU machine: the rates measured on the project's own (docs/plan_model.md)."""


class SyncRoute(StrEnum):
    """``rollout.sync_transport``: how the weights travel from the trainer to the engines at every
    sync (`moe_rl.config.sync_plan`)."""

    AUTO = "auto"
    """The route the recipe's engine, device and placement call for."""
    BUCKETS = "buckets"
    """Each trainer rank's own tensors in buckets: shared memory on its node, a process group to
    other nodes. Works everywhere."""
    DEVICE_IPC = "device_ipc"
    """The whole model in buckets in each trainer GPU's memory, read by the Megatron engine on that
    GPU (colocated, CUDA, one pipeline stage)."""
    VLLM_NCCL = "vllm_nccl"
    """vLLM's NCCL weight transfer from trainer rank 0 (vLLM on CUDA on nodes of their own, one
    pipeline stage)."""
    VLLM_IPC = "vllm_ipc"
    """vLLM's CUDA IPC weight transfer from every trainer GPU (vLLM colocated on CUDA, one pipeline
    stage)."""
    IN_PROCESS = "in_process"
    """The one-process loop's (not a recipe value: the loop chooses it)."""


class ReleaseMemory(StrEnum):
    """``cluster.release_memory``: whether colocated phases give memory back to each other."""

    AUTO = "auto"
    """On when the engines are colocated with the trainer on GPUs (synchronous runs)."""
    ON = "on"
    """On wherever the engines are colocated (on CPU the same phases run, for tests)."""
    OFF = "off"


class QuantMethod(StrEnum):
    """``quant.method``: the number format of the rollout weights."""

    NONE = "none"
    FP8 = "fp8"
    INT8 = "int8"
    INT4_AWQ = "int4_awq"
    NVFP4 = "nvfp4"


class Granularity(StrEnum):
    """``quant.granularity``: what one scale covers."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"


class ReplayMode(StrEnum):
    """``algo.routing_replay``: no replay, the trainer's own routing replayed in its update (R2),
    or the engine's routing replayed in both trainer passes (R3)."""

    OFF = "off"
    R2 = "r2"
    R3 = "r3"


class LrDecay(StrEnum):
    """``trainer.lr_decay_style``."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class Precision(StrEnum):
    """``trainer.precision``."""

    FP32 = "fp32"
    BF16 = "bf16"


class Dispatcher(StrEnum):
    """``trainer.moe_token_dispatcher_type``: Megatron's MoE token dispatcher."""

    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"


class ExpertGemm(StrEnum):
    """``trainer.expert_gemm``: how a MoE layer's local experts multiply."""

    AUTO = "auto"
    """transformer-engine's grouped GEMM where transformer-engine is installed, torch's otherwise."""
    TE = "te"
    """transformer-engine's grouped GEMM (``TEGroupedMLP``); needs transformer-engine."""
    TORCH = "torch"
    """Torch's grouped matrix multiply over all local experts (CUDA, bf16, Hopper or newer); an
    exact per-expert loop elsewhere. Keeps the per-expert weights of ``sequential``."""
    SEQUENTIAL = "sequential"
    """Megatron's ``SequentialMLP``: one expert module after another."""


class EnvOverflow(StrEnum):
    """``env.overflow``: an environment answer longer than what is left of the trajectory's token
    budget (`env.max_tokens`) once a token is kept for the model's turn that reads it."""

    TRUNCATE = "truncate"
    """Its first tokens, as many as fit with one left for the model, are written; the model's turn
    after it takes the budget's last token, and the trajectory counts in `env/truncated_share`."""
    REFUSE = "refuse"
    """The run stops with one line naming the environment, the trajectory and the lengths."""


class RewardPool(StrEnum):
    """``data.reward_pool``: where a step's reward calls run, `data.reward_workers` at a time."""

    THREAD = "thread"
    """Threads of the reward worker: for calls that wait (an HTTP service, an LLM judge, a
    sandbox); a call past `data.reward_timeout_s` is given up, its thread left to end on its own."""
    PROCESS = "process"
    """Processes of their own, each importing the function once: for calls that compute
    (math-verify on long answers); a call past `data.reward_timeout_s` is killed with its process."""


class RewardFailure(StrEnum):
    """``data.reward_on_failure``: a reward call that raises, returns something other than a finite
    number or does not return within `data.reward_timeout_s`."""

    STOP = "stop"
    """The run stops with one line naming the function, the prompt and the cause."""
    ZERO = "zero"
    """The response scores 0, counted in `reward/failed`; the run goes on."""


class LogLevel(StrEnum):
    """``logging.level``."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def _leaf_types(section: type, prefix: str = "") -> dict[str, Any]:
    """Every field of the dataclass ``section`` and its nested sections that is not a section, by
    dotted path, with its type (``X | None`` as ``X``)."""
    found: dict[str, Any] = {}
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        path, tp = f"{prefix}{field.name}", _without_none(hints[field.name])
        found |= _leaf_types(tp, f"{path}.") if dataclasses.is_dataclass(tp) else {path: tp}
    return found


def choice_fields(section: type) -> dict[str, type[StrEnum]]:
    """Every choice field of the dataclass ``section`` and its nested sections, by dotted path: the
    fields whose type is a mode (``Mode`` or ``Mode | None``). Read from the field types, so a
    choice field typed in the schema is in the table by construction; a plain `Enum` field is
    refused (the loader turns the recipe's spelling into a member, which needs the value's text)."""
    found: dict[str, type[StrEnum]] = {}
    for path, tp in _leaf_types(section).items():
        if isinstance(tp, type) and issubclass(tp, Enum):
            if not issubclass(tp, StrEnum):
                raise TypeError(f"{path}: {tp.__name__} is an Enum; a choice field's mode is a StrEnum")
            found[path] = tp
    return found


def list_choice_fields(section: type) -> dict[str, type[StrEnum]]:
    """Every field of ``section`` (and its nested sections) typed ``list[Mode]``, by dotted path:
    each item is a choice of the mode."""
    found: dict[str, type[StrEnum]] = {}
    for path, tp in _leaf_types(section).items():
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(item, type) and issubclass(item, StrEnum):
            found[path] = item
    return found


def _without_none(tp: Any) -> Any:
    """``X`` for ``X | None``; any other type as it is."""
    args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp
