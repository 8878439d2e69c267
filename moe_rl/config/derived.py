"""Quantities a recipe implies, computed in one place from the schema's fields: the longest
sequence a rollout can produce, the data-parallel sizes of the trainer's layout, the response and
sampling budgets, and what an engine holds (its weights in the rollout recipe's bytes, its KV cache
per token and in all). Every rule and every component that needs one of them calls these functions
(`moe-rl plan`'s memory rows and its step time among them). Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from moe_rl.config.flops import ParamCounts
from moe_rl.config.modes import Attention, Granularity, QuantMethod, ReleaseMemory, RunMode
from moe_rl.config.schema import ModelConfig, ParallelConfig, QuantConfig, RecipeConfig

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


def quant_bytes_per_weight(q: QuantConfig) -> float:
    """Bytes per quantized weight, scales included: fp8 1 (+ one fp32 scale per block), int8 1,
    int4-AWQ 0.5 + an fp16 scale per 128, NVFP4 0.5 + an fp8 scale per 16; bf16 otherwise."""
    if q.method == QuantMethod.FP8:
        return 1.0 + (FP32 / q.block_size**2 if q.granularity == Granularity.BLOCK else 0.0)
    if q.method == QuantMethod.INT8:
        return 1.0
    if q.method == QuantMethod.INT4_AWQ:
        return 0.5 + 2 / 128
    if q.method == QuantMethod.NVFP4:
        return 0.5 + 1 / 16
    return float(BF16)


def rollout_weight_bytes(config: RecipeConfig, counts: ParamCounts) -> float:
    """Bytes of one model copy as the engines receive it: quantized linear weights; embeddings,
    LM head, routers, norms and the excluded first/last layers stay bf16."""
    q = config.quant
    kept = counts.embedding + counts.lm_head + counts.final_norm
    kept += counts.num_layers * counts.norms_per_layer + counts.num_moe_layers * counts.router_per_layer
    skipped = [i for i in range(counts.num_layers) if i < q.exclude_first_layers]
    skipped += [i for i in range(counts.num_layers) if i >= counts.num_layers - q.exclude_last_layers]
    for i in set(skipped):
        kept += sum(counts.layer(i)) - counts.norms_per_layer
        kept -= counts.router_per_layer if i >= counts.num_dense_layers else 0
    return kept * BF16 + (counts.total - kept) * quant_bytes_per_weight(q)


def rollout_expert_bytes(config: RecipeConfig, counts: ParamCounts) -> float:
    """Bytes of the routed experts in one model copy as the engines hold it (`rollout_weight_bytes`'
    share of them): quantized, bf16 in the excluded first/last layers."""
    q = config.quant
    layers = range(counts.num_dense_layers, counts.num_layers)
    excluded = sum(
        1 for i in layers if i < q.exclude_first_layers or i >= counts.num_layers - q.exclude_last_layers
    )
    per_layer = counts.num_experts * counts.expert
    return excluded * per_layer * BF16 + (len(layers) - excluded) * per_layer * quant_bytes_per_weight(q)


def kv_bytes_per_token(m: ModelConfig, rollout_tp: int) -> float:
    """bf16 KV cache bytes per token on one engine GPU: GQA shards KV heads over TP (replicated
    when TP > KV heads); MLA caches the latent (r_kv + d_rope) on every TP rank."""
    if m.attention == Attention.MLA:
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * BF16
    heads = max(1, m.num_key_value_heads // rollout_tp)
    return 2 * m.num_layers * heads * m.head_dim * BF16


@dataclass(frozen=True)
class RolloutMemory:
    """One engine GPU: weights, the KV budget left by `gpu_memory_utilization`, its token count."""

    weights_per_gpu: float
    budget_per_gpu: float
    kv_per_token: float

    @property
    def kv_per_gpu(self) -> float:
        return self.budget_per_gpu - self.weights_per_gpu

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_per_gpu // self.kv_per_token))


def rollout_memory(config: RecipeConfig, counts: ParamCounts) -> RolloutMemory:
    """One engine GPU's share of the weights and its KV cache (`RolloutMemory`)."""
    r = config.rollout
    budget = config.cluster.gpu_memory_gib * GIB * r.gpu_memory_utilization
    weights = rollout_weight_bytes(config, counts) / r.tensor_parallel_size
    return RolloutMemory(weights, budget, kv_bytes_per_token(config.model, r.tensor_parallel_size))
