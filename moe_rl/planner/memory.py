"""Memory per GPU of a recipe, computed from the recipe alone (no torch, no GPU).

**Trainer** (Megatron-core, busiest pipeline stage): weights in the training precision, fp32
gradient buffers, Adam states of 12 bytes per parameter (fp32 master copy, m and v; 8 without a
master copy in fp32 training) sharded over data-parallel ranks by the distributed optimizer
(non-expert parameters over DP = world/(TP*PP*CP), expert parameters over the expert DP =
world/(EP*ETP*PP)). Activations are an estimate: the bf16 tensors each layer keeps for backward
(flash attention, no s^2 term), split by TP (sequence parallel) and CP, times the micro-batches in
flight on the first stage (min(PP, micro-batches)), plus fp32 logits and their gradient; with
activation recompute only each layer's input is kept (`trainer_memory`).

**Engine**: one model copy in the rollout recipe's bytes, its share per tensor-parallel GPU, and
the KV cache that ``rollout.gpu_memory_utilization`` leaves (`rollout_memory`).

**Colocated**: a GPU that hosts a trainer rank and its share of an engine, in each phase
(`colocated_memory`), and what a step moves to host memory and back (`released_bytes`).
`memory_checks` holds them against ``cluster.gpu_memory_gib``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_rl.algo.modes import Advantage
from moe_rl.config.derived import (
    BF16,
    FP32,
    GIB,
    PlacementMode,
    data_parallel_size,
    expert_data_parallel_size,
    longest_sequence,
    placement_mode,
    releases_memory,
)
from moe_rl.config.modes import Attention, Granularity, Precision, QuantMethod
from moe_rl.config.schema import ModelConfig, QuantConfig, RecipeConfig
from moe_rl.planner.flops import ParamCounts, count_params, lora_param_counts
from moe_rl.rules import Rule


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


@dataclass(frozen=True)
class Layout:
    """The trainer's parallel layout."""

    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int
    cp: int
    world: int

    dp: int
    """Data-parallel size of the dense part (`moe_rl.config.derived.data_parallel_size`)."""
    expert_dp: int
    """Data-parallel size of the experts."""


def layout(config: RecipeConfig) -> Layout:
    p = config.parallel
    return Layout(
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_model_parallel_size,
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size,
        cp=p.context_parallel_size,
        world=p.trainer_world_size,
        dp=data_parallel_size(p),
        expert_dp=expert_data_parallel_size(p),
    )


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on the busiest trainer GPU."""

    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    critic: float = 0.0
    """The critic's weights, gradients and Adam state (``algo.advantage=gae``), 0 without one."""
    teacher: float = 0.0
    """The distillation teacher's frozen weights on the device (0 without one, or with
    ``teacher.offload``, which keeps them in host memory between its passes)."""
    adapters: int = 0
    """LoRA's trainable parameters on the GPU (``lora.rank`` > 0; the gradients and the optimizer
    hold only them), 0 for a full-weight run."""

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer + self.critic + self.teacher

    @property
    def total(self) -> float:
        return self.static + self.activations


def _stage_params(counts: ParamCounts, lay: Layout, stage: int) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one GPU of pipeline stage `stage`."""
    per_stage = math.ceil(counts.num_layers / lay.pp)
    layers = range(stage * per_stage, min(counts.num_layers, (stage + 1) * per_stage))
    dense = sum(counts.layer(i)[0] for i in layers)
    expert = sum(counts.layer(i)[1] for i in layers)
    if stage == 0:
        dense += counts.embedding
    if stage == lay.pp - 1:
        dense += counts.lm_head + counts.final_norm
    return dense / lay.tp, expert / (lay.ep * lay.etp)


def _attention_activations(m: ModelConfig) -> int:
    """bf16 elements per token one attention block keeps for backward (norm and projection inputs,
    q/k/v, the core-attention output)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.attention == Attention.GQA:
        return 2 * h + (heads + 2 * m.num_key_value_heads) * m.head_dim + heads * m.head_dim
    qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = (m.q_lora_rank or 0) + heads * qk_dim
    kv = m.kv_lora_rank + m.qk_rope_head_dim + heads * (m.qk_nope_head_dim + m.v_head_dim)
    return 2 * h + q + kv + heads * qk_dim + heads * m.v_head_dim


def _layer_activations(m: ModelConfig, lay: Layout, dense: bool) -> float:
    """bf16 elements per local token of one layer on one GPU (SP splits by TP, ETP the experts)."""
    h = m.hidden_size
    if dense:
        mlp = (h + 3 * m.ffn_hidden_size) / lay.tp
    else:
        routed = m.moe_router_topk * (h + 3 * m.moe_ffn_hidden_size / lay.etp)
        shared = m.num_shared_experts * (h + 3 * m.moe_ffn_hidden_size)
        mlp = (2 * m.num_experts + routed + shared) / lay.tp
    return _attention_activations(m) / lay.tp + mlp


def activation_bytes(config: RecipeConfig) -> float:
    """Activation estimate of the busiest GPU (see the module docstring)."""
    m, lay, t = config.model, layout(config), config.trainer
    tokens = t.max_tokens_per_microbatch / lay.cp
    per_stage = math.ceil(m.num_layers / lay.pp)
    seqs = config.rollout.batch_size / (t.num_mini_batches * lay.dp)
    micro_batches = max(1, math.ceil(seqs * longest_sequence(config) / t.max_tokens_per_microbatch))
    in_flight = min(lay.pp, micro_batches)
    if t.recompute_activations:
        kept = per_stage * in_flight * m.hidden_size / lay.tp
        layer = _layer_activations(m, lay, dense=m.num_experts == 0)
        stage0 = (kept + layer) * tokens * BF16
    else:
        layers = [_layer_activations(m, lay, dense=i < m.first_k_dense_layers) for i in range(per_stage)]
        stage0 = in_flight * sum(layers) * tokens * BF16
    logits = 2 * tokens * m.vocab_size / lay.tp * FP32
    if lay.pp == 1:
        return stage0 + logits
    return max(stage0, stage0 / in_flight + logits)


def trainer_memory(
    config: RecipeConfig, counts: ParamCounts, teacher: ModelConfig | None = None
) -> TrainerMemory:
    """Weights, gradients, optimizer states and activations on the busiest trainer GPU; with a
    critic its weights, gradients and optimizer states (the policy's model with a value head of
    ``hidden_size`` weights for the LM head, on the same ranks); with a distillation `teacher`
    (its model) its weights in the trainer's layout, unless ``teacher.offload`` keeps them in host
    memory."""
    static = _static_memory(config, counts)
    if config.lora.rank > 0:  # the base frozen: gradients and Adam state for the adapters alone
        adapters = _static_memory(config, lora_param_counts(config.model, config.lora))
        static = dataclasses.replace(
            static, params=static.params + adapters.params, weights=static.weights + adapters.weights,
            grads=adapters.grads, optimizer=adapters.optimizer, adapters=adapters.params,
        )  # fmt: skip
    critic = 0.0
    if config.algo.advantage == Advantage.GAE:
        critic = _static_memory(config, dataclasses.replace(counts, lm_head=config.model.hidden_size)).static
    held = 0.0
    if teacher is not None and not config.teacher.offload:
        held = _static_memory(config, count_params(teacher)).weights
    return dataclasses.replace(static, activations=activation_bytes(config), critic=critic, teacher=held)


def _static_memory(config: RecipeConfig, counts: ParamCounts) -> TrainerMemory:
    """Weights, gradients and optimizer states of ``counts``'s model on the busiest trainer GPU."""
    lay = layout(config)
    fp32_training = config.trainer.precision == Precision.FP32
    weight_bytes = FP32 if fp32_training else BF16
    adam_bytes = 8 if fp32_training else 12
    best: TrainerMemory | None = None
    for stage in range(lay.pp):
        dense, expert = _stage_params(counts, lay, stage)
        if config.parallel.use_distributed_optimizer:
            optimizer = adam_bytes * (dense / lay.dp + expert / lay.expert_dp)
        else:
            optimizer = adam_bytes * (dense + expert)
        params = dense + expert
        memory = TrainerMemory(round(params), params * weight_bytes, params * FP32, optimizer, 0.0)
        if best is None or memory.static > best.static:
            best = memory
    assert best is not None
    return best


def routing_trace_bytes_per_token(m: ModelConfig) -> int:
    """R3 trace: top-k expert ids per MoE layer, uint8 when experts <= 256, else uint16."""
    if m.num_experts == 0:
        return 0
    width = 1 if m.num_experts <= 256 else 2
    return (m.num_layers - m.first_k_dense_layers) * m.moe_router_topk * width


@dataclass(frozen=True)
class ColocatedMemory:
    """One GPU that hosts a trainer rank and its share of an engine, in each phase."""

    releases: bool
    """Colocated phases give memory back (`cluster.release_memory`)."""
    trainer_generating: float
    """What the trainer keeps on the GPU while the engine generates."""
    engine_generating: float
    """What the engine takes to generate (``rollout.gpu_memory_utilization`` of the GPU)."""
    trainer_training: float
    engine_training: float
    """What the engine keeps while the trainer works (asleep: nothing of its weights or KV cache)."""

    @property
    def generate(self) -> float:
        return self.trainer_generating + self.engine_generating

    @property
    def train(self) -> float:
        return self.trainer_training + self.engine_training

    @property
    def peak(self) -> float:
        return max(self.generate, self.train)


def colocated_memory(config: RecipeConfig, trainer: TrainerMemory, rollout: RolloutMemory) -> ColocatedMemory:
    """The colocated phases on one GPU: while the engine generates the trainer keeps its weights
    (nothing with `cluster.offload_params`) once its optimizer state and gradients are released, and
    everything when they are not; while the trainer works a sleeping engine keeps nothing."""
    releases = releases_memory(config, "cuda")
    kept = 0.0 if config.cluster.offload_params else trainer.weights
    generating = kept if releases else trainer.static
    return ColocatedMemory(
        releases,
        generating,
        rollout.budget_per_gpu,
        trainer.total,
        0.0 if releases else rollout.budget_per_gpu,
    )


def memory_checks(config: RecipeConfig, trainer: TrainerMemory, rollout: RolloutMemory) -> list[Rule]:
    """Budget checks against `cluster.gpu_memory_gib` (GPU recipes only); colocated, each phase's
    sum on one GPU."""
    cap = config.cluster.gpu_memory_gib * GIB
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    colocated = []
    if placement_mode(config) == PlacementMode.COLOCATED:
        c = colocated_memory(config, trainer, rollout)
        how = f"cluster.release_memory={config.cluster.release_memory}" + (
            ", memory released between phases" if c.releases else ", nothing released between phases"
        )
        colocated = [
            Rule("colocated generation fits", c.generate <= cap,
                 f"trainer {gib(c.trainer_generating)} + engine {gib(c.engine_generating)} = {gib(c.generate)} of "
                 f"{gib(cap)} per GPU ({how}); lower rollout.gpu_memory_utilization, set cluster.offload_params=true, "
                 "or place the engines on nodes of their own"),
            Rule("colocated training fits", c.train <= cap,
                 f"trainer {gib(c.trainer_training)} + engine {gib(c.engine_training)} = {gib(c.train)} of "
                 f"{gib(cap)} per GPU ({how})", fatal=False),
        ]  # fmt: skip
    return [
        *colocated,
        Rule(
            "trainer states fit",
            trainer.static <= cap,
            f"weights + grads + optimizer {gib(trainer.static)} of {gib(cap)}",
        ),
        Rule(
            "trainer activations fit",
            trainer.total <= cap,
            f"with activations (estimate) {gib(trainer.total)} of {gib(cap)}",
            fatal=False,
        ),
        Rule(
            "rollout weights fit",
            rollout.weights_per_gpu < rollout.budget_per_gpu,
            f"{gib(rollout.weights_per_gpu)} of {gib(rollout.budget_per_gpu)} "
            f"(rollout.gpu_memory_utilization={config.rollout.gpu_memory_utilization})",
        ),
        Rule(
            "KV cache holds a sequence",
            rollout.kv_tokens >= longest_sequence(config),
            f"{rollout.kv_tokens} tokens per engine, longest sequence {longest_sequence(config)}",
        ),
    ]


def released_bytes(config: RecipeConfig, trainer: TrainerMemory) -> float:
    """Bytes per trainer GPU a colocated step on GPUs moves to host memory and back
    (`colocated_memory`): gradients and optimizer state, and the weights with
    ``cluster.offload_params``; 0 where nothing is released."""
    if config.cluster.gpus_per_node == 0 or not releases_memory(config, "cuda"):
        return 0.0
    held = trainer.grads + trainer.optimizer + trainer.critic  # the critic's weights too: no sync reads them
    return held + (trainer.weights if config.cluster.offload_params else 0.0)
