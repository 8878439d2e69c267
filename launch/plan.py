"""`moe-rl plan`: what a recipe costs and whether Megatron-core and vLLM will accept its layout,
computed from the recipe alone (no torch, no GPU).

Parameter counts (SwiGLU MLPs, RMSNorm, no linear biases, as in Qwen3-MoE and DeepSeek-V3; the
projections' sizes are `moe_rl.config.flops`'s, the one home of that arithmetic):

- embedding `V*h`; LM head `V*h` unless tied; final norm `h`;
- per layer: two norms `2h`, plus attention
  - GQA: `h*H*d` (q) + `2*h*K*d` (k, v) + `H*d*h` (o) + `2d` (Qwen3's per-head q/k norms);
  - MLA: q = `h*r_q + r_q + r_q*H*(d_nope+d_rope)` with a query LoRA (else `h*H*(d_nope+d_rope)`),
    kv = `h*(r_kv+d_rope) + r_kv + r_kv*H*(d_nope+d_v)`, o = `H*d_v*h`;
- the first `first_k_dense_layers` layers: a dense MLP `3*h*ffn`;
- every other layer: router `h*E` (+ `E` expert bias), `E` routed experts of `3*h*f_e` each, and
  `S` shared experts of `3*h*f_e` each.

Active parameters per token: everything except the `E - k` routed experts a token skips in each
MoE layer. `active` counts the embedding table (Qwen and Kimi report it this way);
`active_without_embedding` drops the input embedding, as DeepSeek-V3 reports (36.6B).

Memory per GPU (Megatron-core, busiest pipeline stage): weights in the training precision, fp32
gradient buffers, Adam states of 12 bytes per parameter (fp32 master copy, m and v; 8 without a
master copy in fp32 training) sharded over data-parallel ranks by the distributed optimizer
(non-expert parameters over DP = world/(TP*PP*CP), expert parameters over the expert DP =
world/(EP*ETP*PP)). Activations are an estimate: the bf16 tensors each layer keeps for backward
(flash attention, no s^2 term), split by TP (sequence parallel) and CP, times the micro-batches in
flight on the first stage (min(PP, micro-batches)), plus fp32 logits and their gradient; with
activation recompute only each layer's input is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moe_rl.config import ConfigError, RecipeConfig, load_recipe
from moe_rl.config.derived import (
    PlacementMode,
    data_parallel_size,
    expert_data_parallel_size,
    longest_sequence,
    placement_mode,
    releases_memory,
)
from moe_rl.config.flops import attention_weights, mlp_weights
from moe_rl.config.modes import Attention, Family, Granularity, Precision, QuantMethod
from moe_rl.config.schema import ModelConfig, QuantConfig
from moe_rl.config.sync_plan import SyncPlan, sync_plan
from moe_rl.device import RunDevice
from moe_rl.orchestration.preflight import preflight, target_machine
from moe_rl.rules import Rule

GIB = 1024**3
BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, by component."""

    embedding: int
    lm_head: int
    final_norm: int
    attention_per_layer: int
    norms_per_layer: int
    dense_mlp_per_layer: int
    expert: int
    shared_experts_per_layer: int
    router_per_layer: int
    num_layers: int
    num_dense_layers: int
    num_experts: int
    topk: int

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def layer(self, index: int) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of layer `index`."""
        base = self.attention_per_layer + self.norms_per_layer
        if index < self.num_dense_layers:
            return base + self.dense_mlp_per_layer, 0
        return base + self.router_per_layer + self.shared_experts_per_layer, self.num_experts * self.expert

    def components(self) -> list[tuple[str, int, int]]:
        """(name, total, active) rows that add up to `total` and `active`."""
        moe, dense = self.num_moe_layers, self.num_dense_layers
        return [
            ("embedding", self.embedding, self.embedding),
            (
                "attention",
                self.num_layers * self.attention_per_layer,
                self.num_layers * self.attention_per_layer,
            ),
            ("dense MLP", dense * self.dense_mlp_per_layer, dense * self.dense_mlp_per_layer),
            ("routed experts", moe * self.num_experts * self.expert, moe * self.topk * self.expert),
            ("shared experts", moe * self.shared_experts_per_layer, moe * self.shared_experts_per_layer),
            ("routers", moe * self.router_per_layer, moe * self.router_per_layer),
            ("norms", self.norms, self.norms),
            ("LM head", self.lm_head, self.lm_head),
        ]

    @property
    def total(self) -> int:
        return sum(total for _, total, _ in self.components())

    @property
    def norms(self) -> int:
        return self.num_layers * self.norms_per_layer + self.final_norm

    @property
    def active(self) -> int:
        return sum(active for _, _, active in self.components())

    @property
    def active_without_embedding(self) -> int:
        return self.active - self.embedding

    @property
    def expert_total(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert


def attention_params(m: ModelConfig) -> int:
    """Attention parameters of one layer: the projections (`moe_rl.config.flops.attention_weights`)
    and their norms, Qwen3's per-head q/k norms (GQA) or the norms of MLA's query and key-value
    latents."""
    if m.attention == Attention.GQA:
        norms = 2 * m.head_dim if m.family == Family.QWEN3_MOE else 0
    else:
        norms = (m.q_lora_rank or 0) + m.kv_lora_rank
    return attention_weights(m) + norms


def count_params(m: ModelConfig) -> ParamCounts:
    """Parameter counts of the model a recipe describes."""
    h = m.hidden_size
    expert = mlp_weights(h, m.moe_ffn_hidden_size)
    moe = m.num_experts > 0
    return ParamCounts(
        embedding=m.vocab_size * h,
        lm_head=0 if m.tie_word_embeddings else m.vocab_size * h,
        final_norm=h,
        attention_per_layer=attention_params(m),
        norms_per_layer=2 * h,
        dense_mlp_per_layer=mlp_weights(h, m.ffn_hidden_size),
        expert=expert if moe else 0,
        shared_experts_per_layer=m.num_shared_experts * expert if moe else 0,
        router_per_layer=(h * m.num_experts + (m.num_experts if m.moe_router_enable_expert_bias else 0)),
        num_layers=m.num_layers,
        num_dense_layers=m.first_k_dense_layers if moe else m.num_layers,
        num_experts=m.num_experts,
        topk=m.moe_router_topk if moe else 0,
    )


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

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

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


def trainer_memory(config: RecipeConfig, counts: ParamCounts) -> TrainerMemory:
    """Weights, gradients, optimizer states and activations on the busiest trainer GPU."""
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
    return TrainerMemory(best.params, best.weights, best.grads, best.optimizer, activation_bytes(config))


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
    r = config.rollout
    budget = config.cluster.gpu_memory_gib * GIB * r.gpu_memory_utilization
    weights = rollout_weight_bytes(config, counts) / r.tensor_parallel_size
    return RolloutMemory(weights, budget, kv_bytes_per_token(config.model, r.tensor_parallel_size))


def routing_trace_bytes_per_token(m: ModelConfig) -> int:
    """R3 trace: top-k expert ids per MoE layer, uint8 when experts <= 256, else uint16."""
    if m.num_experts == 0:
        return 0
    width = 1 if m.num_experts <= 256 else 2
    return (m.num_layers - m.first_k_dense_layers) * m.moe_router_topk * width


def constraint_checks(config: RecipeConfig, paths: bool = True) -> list[Rule]:
    """The rules of every component that runs the recipe (`moe_rl.orchestration.preflight`),
    against the machine the recipe describes: the recipe's own consistency and the engine's
    capabilities as one row each (with the engine's warnings), the rewards', the trainer's and
    placement's rules one by one with their numbers."""
    sections = {section.component: section for section in preflight(config, paths=paths)}
    recipe = sections["recipe"]
    if recipe.broken is not None:
        return [Rule("recipe", False, recipe.error() or "")]
    rows = [Rule("recipe", True, "consistent (moe_rl.config.validate)")]
    rows += [*sections["inputs"].rules, *sections["reward"].rules, *sections["trainer"].rules]
    engine = sections["engine"]
    rows.append(
        Rule(
            "engine capabilities",
            engine.broken is None,
            engine.broken.detail if engine.broken else "the engine can run it",
        )
    )
    rows += engine.warnings
    return rows + list(sections["placement"].rules)


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


@dataclass(frozen=True)
class Plan:
    """Everything `moe-rl plan` reports about one recipe."""

    config: RecipeConfig
    counts: ParamCounts
    trainer: TrainerMemory
    rollout: RolloutMemory
    checks: list[Rule]
    sync: SyncPlan | None = None
    """How every sync moves the weights (None: the recipe's sync route is refused, see `checks`)."""

    @property
    def failures(self) -> list[Rule]:
        return [c for c in self.checks if c.broken]

    @property
    def ok(self) -> bool:
        return not self.failures


def make_plan(config: RecipeConfig, paths: bool = True) -> Plan:
    counts = count_params(config.model)
    trainer = trainer_memory(config, counts)
    rollout = rollout_memory(config, counts)
    checks = constraint_checks(config, paths)
    if config.cluster.gpus_per_node > 0:
        checks += memory_checks(config, trainer, rollout)
    return Plan(config, counts, trainer, rollout, checks, _sync_plan(config))


def _sync_plan(config: RecipeConfig) -> SyncPlan | None:
    """The recipe's weight-sync plan on the machine it describes (None when its route is refused)."""
    on_cuda = target_machine(config).cuda and config.run.device != RunDevice.CPU
    try:
        return sync_plan(config, "cuda" if on_cuda else "cpu")
    except ValueError:
        return None


def node_overrides(config: RecipeConfig, nodes: int | None, gpus_per_node: int | None) -> list[str]:
    """Overrides that move a recipe onto `nodes` nodes of `gpus_per_node` GPUs: the rollout keeps
    its nodes, the trainer takes the rest, and on GPUs the trainer world size follows."""
    c = config.cluster
    gpus = c.gpus_per_node if gpus_per_node is None else gpus_per_node
    trainer_nodes = c.trainer_nodes if nodes is None else nodes - c.rollout_nodes
    if trainer_nodes < 1:
        raise ConfigError(f"--nodes {nodes} leaves no trainer node (cluster.rollout_nodes={c.rollout_nodes})")
    if gpus < 0:
        raise ConfigError(f"--gpus-per-node {gpus} must be >= 0")
    out = [] if gpus_per_node is None else [f"cluster.gpus_per_node={gpus}"]
    if nodes is not None:
        out += [f"cluster.nodes={nodes}", f"cluster.trainer_nodes={trainer_nodes}"]
    if gpus and (nodes is not None or gpus_per_node is not None):
        out.append(f"parallel.trainer_world_size={trainer_nodes * gpus}")
    return out


def _billions(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.3f} M"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 100 else f"{n / 1024**2:,.2f} MiB"


def _params_table(plan: Plan):
    from rich.table import Table

    table = Table(title=f"Parameters ({plan.config.model.family}, {plan.config.model.attention})")
    table.add_column("component")
    table.add_column("total", justify="right")
    table.add_column("active / token", justify="right")
    for name, total, active in plan.counts.components():
        table.add_row(name, _billions(total), _billions(active))
    table.add_row(
        "[bold]all", f"[bold]{_billions(plan.counts.total)}", f"[bold]{_billions(plan.counts.active)}"
    )
    table.add_row("without input embedding", "", _billions(plan.counts.active_without_embedding))
    return table


def _layout_rows(plan: Plan) -> list[tuple[str, str]]:
    c, r, lay = plan.config.cluster, plan.config.rollout, layout(plan.config)
    vpp = f" VPP {lay.vpp}" if lay.vpp else ""
    return [
        ("trainer", f"{c.trainer_nodes} node(s) x {c.gpus_per_node} GPU, world {lay.world}"),
        (
            "parallel",
            f"TP {lay.tp} PP {lay.pp}{vpp} CP {lay.cp} EP {lay.ep} ETP {lay.etp} "
            f"DP {lay.dp} expert-DP {lay.expert_dp}",
        ),
        (
            "rollout",
            f"{r.engine}: {r.num_engines} engine(s) x TP {r.tensor_parallel_size} on "
            f"{c.rollout_nodes or 'the trainer'} node(s), weights {plan.config.quant.name}",
        ),
    ]


def _memory_rows(plan: Plan) -> list[tuple[str, str]]:
    t, r, m = plan.trainer, plan.rollout, plan.config.model
    seqs = r.kv_tokens // longest_sequence(plan.config)
    return [
        ("trainer params / GPU", _billions(t.params)),
        ("  weights", _gib(t.weights)),
        ("  gradients (fp32)", _gib(t.grads)),
        ("  optimizer (Adam)", _gib(t.optimizer)),
        ("  activations (estimate)", _gib(t.activations)),
        ("  total", f"{_gib(t.total)} of {plan.config.cluster.gpu_memory_gib:g} GiB"),
        ("rollout weights / GPU", _gib(r.weights_per_gpu)),
        ("  KV cache budget / GPU", _gib(r.kv_per_gpu)),
        ("  KV bytes / token / GPU", f"{r.kv_per_token:,.0f} B ({m.attention})"),
        ("  KV tokens / engine", f"{r.kv_tokens:,} ({seqs:,} full-length sequences)"),
        *_colocated_rows(plan),
    ]


def _colocated_rows(plan: Plan) -> list[tuple[str, str]]:
    """Colocated on GPUs: what one GPU holds in each phase."""
    cfg = plan.config
    if placement_mode(cfg) != PlacementMode.COLOCATED or cfg.cluster.gpus_per_node == 0:
        return []
    c = colocated_memory(cfg, plan.trainer, plan.rollout)
    cap = f"{cfg.cluster.gpu_memory_gib:g} GiB"
    released = "memory released between phases" if c.releases else "nothing released between phases"
    return [
        (f"colocated GPU ({released})", f"peak {_gib(c.peak)} of {cap}"),
        (
            "  generation: trainer + engine",
            f"{_gib(c.trainer_generating)} + {_gib(c.engine_generating)} = {_gib(c.generate)}",
        ),
        (
            "  training: trainer + engine",
            f"{_gib(c.trainer_training)} + {_gib(c.engine_training)} = {_gib(c.train)}",
        ),
    ]


def _traffic_rows(plan: Plan) -> list[tuple[str, str]]:
    cfg, counts = plan.config, plan.counts
    trace = routing_trace_bytes_per_token(cfg.model)
    tokens = cfg.rollout.batch_size * longest_sequence(cfg)
    width = "uint8" if cfg.model.num_experts <= 256 else "uint16"
    synced = rollout_weight_bytes(cfg, counts)
    return [
        (
            "routing trace / token",
            f"{trace:,} B ({width}, {counts.num_moe_layers} layers x top-{counts.topk})",
        ),
        ("routing traces / step", f"{_gib(trace * tokens)} (<= {tokens:,} tokens)"),
        ("weight sync / step, bf16", _gib(counts.total * BF16)),
        (
            f"weight sync / step, {cfg.quant.name}",
            f"{_gib(synced)} per engine, {_gib(synced * cfg.rollout.num_engines)} in all",
        ),
    ]


def _sync_rows(plan: Plan) -> list[tuple[str, str]]:
    """The weight-sync plan (`moe_rl.config.sync_plan`): route, why, what travels, who sends."""
    from moe_rl.config.sync_plan import ROUTE_WORDS

    sync = plan.sync
    unit = "vLLM's packed buffers" if sync.vllm_transfer else "buckets"
    rows = [
        ("route", f"{sync.route}: {ROUTE_WORDS[sync.route]}"),
        ("chosen by", sync.chosen_by),
        ("what travels", f"{sync.wire}, in {unit} of {_gib(sync.bucket_bytes)}"),
        ("senders", sync.senders),
    ]
    if plan.config.logging.diagnose_every:
        rows.append(("probe's reference model", f"{sync.route_for(reference=True)}, full precision"))
    return rows


def _rows_table(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _checks_table(plan: Plan):
    from rich.table import Table

    table = Table(title="Constraints")
    for name in ("check", "", "detail"):
        table.add_column(name)
    for c in plan.checks:
        mark = "[green]ok" if c.ok else ("[red]FAIL" if c.fatal else "[yellow]warn")
        table.add_row(c.name, mark, shown_detail(c))
    return table


def shown_detail(rule: Rule) -> str:
    """What a row says: a rule that holds shows its values, one that does not (refused, or a
    warning) its values and the advice that helps (`Rule.advice`)."""
    return rule.values if rule.ok else rule.detail


def render(plan: Plan, console) -> None:
    """Print the plan's tables and the PASS / FAIL verdict."""
    console.print(_params_table(plan))
    console.print(_rows_table("Layout", _layout_rows(plan)))
    if plan.config.cluster.gpus_per_node > 0:
        console.print(_rows_table("Memory per GPU", _memory_rows(plan)))
    console.print(_rows_table("Per RL step", _traffic_rows(plan)))
    if plan.sync is not None:
        console.print(_rows_table("Weight sync", _sync_rows(plan)))
    console.print(_checks_table(plan))
    if plan.ok:
        console.print("[bold green]PASS")
    else:
        console.print("[bold red]FAIL: " + "; ".join(f"{c.name} ({c.detail})" for c in plan.failures))


def plan_command(
    recipe: str, overrides: Sequence[str] = (), nodes: int | None = None, paths: bool = True
) -> int:
    """`moe-rl plan`: print the plan of `recipe`; exit code 1 when a constraint fails."""
    from rich.console import Console

    config = load_recipe(recipe, overrides)
    if nodes is not None:
        config = load_recipe(recipe, [*overrides, *node_overrides(config, nodes, None)])
    plan = make_plan(config, paths)
    render(plan, Console(highlight=False, width=140))
    return 0 if plan.ok else 1
