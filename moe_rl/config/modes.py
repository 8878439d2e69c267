"""The modes a recipe chooses among, typed: one `StrEnum` per choice field, its values the
recipe's spelling, its names those values in capitals. The loader (`moe_rl.config.loader`) turns
the YAML strings into members, naming the field and the valid values when a string is none of
them; code compares members (``config.run.mode == RunMode.ASYNC``), never strings.

The algorithm's choices live with the math (`moe_rl.algo.modes`), the device's with the device
(`moe_rl.device.RunDevice`); this module gathers every choice field of the schema in `CHOICES`.
Imports nothing heavy.
"""

from __future__ import annotations

from enum import StrEnum

from moe_rl.algo.modes import (
    Advantage,
    Aggregation,
    Divergence,
    KLEstimator,
    Objective,
    PolicyMode,
    RejectionAggregation,
    TISMode,
)
from moe_rl.device import RunDevice


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


class LogLevel(StrEnum):
    """``logging.level``."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


CHOICES: dict[str, type[StrEnum]] = {
    "run.mode": RunMode,
    "run.device": RunDevice,
    "model.family": Family,
    "model.attention": Attention,
    "model.moe_router_score_function": ScoreFunction,
    "model.rope_scaling_type": RopeScaling,
    "rollout.engine": Engine,
    "cluster.release_memory": ReleaseMemory,
    "quant.method": QuantMethod,
    "quant.granularity": Granularity,
    "algo.objective": Objective,
    "algo.advantage": Advantage,
    "algo.aggregation": Aggregation,
    "algo.policy_mode": PolicyMode,
    "algo.routing_replay": ReplayMode,
    "algo.kl.estimator": KLEstimator,
    "algo.corrections.tis.mode": TISMode,
    "algo.corrections.rejection.divergence": Divergence,
    "algo.corrections.rejection.aggregation": RejectionAggregation,
    "trainer.lr_decay_style": LrDecay,
    "trainer.precision": Precision,
    "trainer.moe_token_dispatcher_type": Dispatcher,
    "logging.level": LogLevel,
}
"""Every choice field of the recipe and its mode (the one list of valid values)."""
