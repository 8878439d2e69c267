"""Quantities a recipe implies, computed in one place from the schema's fields: the longest
sequence a rollout can produce, the data-parallel sizes of the trainer's layout, the response and
sampling budgets, and what an engine holds (its weights in the rollout recipe's bytes, its KV cache
per token and in all). Every rule and every component that needs one of them calls these functions
(`moe-rl plan`'s memory rows and its step time among them). Imports nothing heavy.
"""

from __future__ import annotations

from enum import StrEnum

from moe_rl.config.modes import QuantMethod, ReleaseMemory, RunMode
from moe_rl.config.schema import ParallelConfig, QuantConfig, RecipeConfig
from moe_rl.device import RunDevice

GIB = 1024**3
BF16 = 2
FP32 = 4


def response_limit_key(config: RecipeConfig) -> str:
    """The recipe key that bounds a response: ``env.max_tokens`` with an environment, else
    ``rollout.max_new_tokens`` (how error messages name the budget)."""
    return "env.max_tokens" if config.env.name else "rollout.max_new_tokens"


def max_response_tokens(config: RecipeConfig) -> int:
    """Longest response a recipe can produce: `rollout.max_new_tokens`, or with an environment its
    token budget `env.max_tokens` (the model's turns and the environment's tokens)."""
    return config.env.max_tokens if config.env.name else config.rollout.max_new_tokens


def max_sampled_tokens(config: RecipeConfig) -> int:
    """Most tokens the model samples in one trajectory: `rollout.max_new_tokens`, or with an
    environment at most `env.max_turns` turns of it within `env.max_tokens`."""
    r, env = config.rollout, config.env
    if not env.name:
        return r.max_new_tokens
    return min(env.max_tokens, env.max_turns * r.max_new_tokens)


def sampling_truncates(top_k: int, top_p: float) -> bool:
    """Whether top-k or top-p sampling removes tokens from the vocabulary (the engine's log-probs
    are then over the kept set, and a sampling mask carries information). ``top_k`` -1 and
    ``top_p`` 1 are off."""
    return top_k > 0 or top_p < 1.0


def longest_sequence(config: RecipeConfig) -> int:
    """The longest sequence a rollout can produce: ``data.max_prompt_len`` plus the longest
    response (`max_response_tokens`)."""
    return config.data.max_prompt_len + max_response_tokens(config)


def data_parallel_size(p: ParallelConfig) -> int:
    """Data-parallel ranks of the dense part: world / (TP * PP * CP) (at least 1)."""
    return max(
        1,
        p.trainer_world_size
        // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size),
    )


def expert_data_parallel_size(p: ParallelConfig) -> int:
    """Data-parallel ranks of the experts: world / (EP * ETP * PP) (at least 1)."""
    return max(
        1,
        p.trainer_world_size
        // (p.expert_model_parallel_size * p.expert_tensor_parallel_size * p.pipeline_model_parallel_size),
    )


def quant_needs_cuda(q: QuantConfig) -> bool:
    """The quantization recipe runs only on a CUDA GPU: NVFP4 (its kernels need one), or a recipe
    that says so (``quant.requires_cuda``)."""
    return q.requires_cuda or q.method == QuantMethod.NVFP4


def num_moe_layers(config: RecipeConfig) -> int:
    """MoE layers of the model: every layer after the first ``model.first_k_dense_layers`` (none for
    a dense model)."""
    m = config.model
    return m.num_layers - m.first_k_dense_layers if m.num_experts else 0


def routing_trace_bytes(config: RecipeConfig, bytes_per_id: int = 2) -> int:
    """Bytes of the routed experts of one rollout batch at its longest: every token of
    ``rollout.batch_size`` sequences of `longest_sequence`, top-k expert ids per MoE layer
    (``bytes_per_id`` each: vLLM keeps int16)."""
    m = config.model
    return (
        config.rollout.batch_size
        * longest_sequence(config)
        * num_moe_layers(config)
        * m.moe_router_topk
        * bytes_per_id
    )


class PlacementMode(StrEnum):
    """Where the rollout engines run relative to the trainer (`placement_mode`)."""

    COLOCATED = "colocated"
    """On the trainer's nodes: on a GPU cluster each GPU hosts one trainer rank and its share of an
    engine, and each side gives its memory back while the other works."""
    DISAGGREGATED = "disaggregated"
    """On nodes of their own (``cluster.rollout_nodes``)."""


def placement_mode(config: RecipeConfig) -> PlacementMode:
    """Colocated when ``cluster.rollout_nodes`` is 0, else disaggregated."""
    return PlacementMode.COLOCATED if config.cluster.rollout_nodes == 0 else PlacementMode.DISAGGREGATED


def target_device(config: RecipeConfig) -> str:
    """The device a recipe is meant for, whatever runs it: ``cuda`` when ``run.device`` says so, or
    ``auto`` on a cluster with GPUs (``cluster.gpus_per_node > 0``); else ``cpu``."""
    device = config.run.device
    cuda = device == RunDevice.CUDA or (device == RunDevice.AUTO and config.cluster.gpus_per_node > 0)
    return "cuda" if cuda else "cpu"


def releases_memory(config: RecipeConfig, device: str) -> bool:
    """Whether colocated phases give memory back (``cluster.release_memory``) on ``device``: `on` when
    colocated; `auto` when colocated on CUDA in a synchronous run (an asynchronous one generates while
    it trains: the two phases hold their memory at once)."""
    mode = config.cluster.release_memory
    if mode == ReleaseMemory.OFF or placement_mode(config) != PlacementMode.COLOCATED:
        return False
    return mode == ReleaseMemory.ON or (device == "cuda" and config.run.mode == RunMode.SYNC)


CORRECTIONS_OFF = (
    "algo.routing_replay=off",
    "algo.corrections.keep_sampling_mask=false",
    "algo.corrections.icepop.enabled=false",
    "algo.corrections.opsm.enabled=false",
    "algo.corrections.tis.mode=off",
    "algo.corrections.rejection.enabled=false",
)
"""Recipe overrides that turn every training–inference correction off: routing replay,
keep-sampling-mask, IcePop, OPSM, TIS and rejection (the plain arm of a comparison; a run with no
sampling policy to correct for)."""
