"""Model FLOPs of a recipe's model, counted from its shape: the one home of the count that the
training loop's ``perf/tflops`` and ``perf/mfu``, `bench/trainer_step.py` and `moe-rl plan`'s step
time use, of the projection sizes it is counted from (`attention_weights`, `mlp_weights`), and of
the parameter counts by component (`count_params`) that `moe-rl plan` prints and budgets memory with.

A multiply-add is 2 FLOPs. Counted per token of a forward pass: every product with a weight
matrix (attention projections, GQA or MLA with its low-rank paths; the router; the routed experts
a token is sent to, top-k of them; shared experts; dense MLPs of the first layers; the output
layer), and the attention scores and their weighted sum, which depend on how many keys each query
sees (causal: a sequence of ``s`` tokens has ``s(s+1)/2`` query-key pairs). Norms, activations,
rotary embeddings, softmax and the embedding lookup are left out, as in the usual MFU accounting.
A backward pass is twice its forward; activation recompute is not counted (model FLOPs, not
hardware FLOPs).

Parameter counts (SwiGLU MLPs, RMSNorm, no linear biases, as in Qwen3-MoE and DeepSeek-V3):

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from moe_rl.config.modes import Attention, Family, LoraTarget
from moe_rl.config.schema import ModelConfig

BACKWARD_FACTOR = 2.0
"""A backward pass costs twice its forward (gradients of inputs and of weights)."""
GATED_PROJECTIONS = 3
"""A SwiGLU MLP's weight matrices: gate, up and down."""


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of one model: per token of its weight products, by part, and per causal
    query-key pair of its attention."""

    attention: float
    """Per token, all layers: Q, K, V and output projections (with MLA's low-rank paths)."""
    router: float
    """Per token, the MoE layers' router logits."""
    experts: float
    """Per token, the routed experts it is sent to (top-k per MoE layer)."""
    shared_experts: float
    """Per token, the MoE layers' shared experts."""
    dense_mlp: float
    """Per token, the MLPs of the dense layers."""
    output: float
    """Per token, the output layer (logits over the vocabulary)."""
    per_pair: float
    """Per query-key pair, all layers: the scores (Q·K) and the weighted sum of values."""

    @property
    def per_token(self) -> float:
        """Forward FLOPs per token of the weight products."""
        return (
            self.attention + self.router + self.experts + self.shared_experts + self.dense_mlp + self.output
        )

    def forward(self, lengths: Iterable[int]) -> float:
        """Forward FLOPs over causal sequences of these lengths."""
        lengths = [int(n) for n in lengths]
        return self.per_token * sum(lengths) + self.per_pair * causal_pairs(lengths)

    def forward_backward(self, lengths: Iterable[int]) -> float:
        """A training pass over these sequences: forward and backward."""
        return (1.0 + BACKWARD_FACTOR) * self.forward(lengths)


def causal_pairs(lengths: Iterable[int]) -> int:
    """Query-key pairs of causal attention over sequences of these lengths: ``Σ s(s+1)/2``."""
    return sum(int(n) * (int(n) + 1) // 2 for n in lengths)


def attention_weights(model: ModelConfig) -> int:
    """Weight elements of one layer's attention projections: Q, K, V and the output, MLA's through
    its low-rank paths (H -> r_q -> heads for the query with a query LoRA, H -> r_kv + d_rope ->
    heads for keys and values). A token's multiply-adds in them, and the projections' parameters
    (`moe-rl plan` adds the norms)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.attention == Attention.MLA:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        rank = model.q_lora_rank
        q = h * rank + rank * heads * qk if rank else h * heads * qk
        kv = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank * heads * (
            model.qk_nope_head_dim + model.v_head_dim
        )
        return q + kv + heads * model.v_head_dim * h
    d = model.head_dim
    return h * heads * d + 2 * h * model.num_key_value_heads * d + heads * d * h


def mlp_weights(hidden: int, ffn: int) -> int:
    """Weight elements of one SwiGLU MLP (an expert, a shared expert or a dense layer's MLP): its
    gate, up and down projections."""
    return GATED_PROJECTIONS * hidden * ffn


def _pair_flops(model: ModelConfig) -> int:
    """Multiply-adds of one layer per causal query-key pair: the score (Q·K) and the weighted sum
    of the values, over all heads."""
    heads = model.num_attention_heads
    if model.attention == Attention.MLA:
        return heads * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)
    return 2 * heads * model.head_dim


def model_flops(model: ModelConfig) -> ModelFlops:
    """The forward FLOPs of ``model`` (see the module docstring)."""
    h = model.hidden_size
    moe_layers = (
        0 if model.num_experts <= 0 else model.num_layers - min(model.first_k_dense_layers, model.num_layers)
    )
    dense_layers = model.num_layers - moe_layers
    expert = mlp_weights(h, model.moe_ffn_hidden_size)
    return ModelFlops(
        attention=2.0 * model.num_layers * attention_weights(model),
        router=2.0 * moe_layers * h * max(model.num_experts, 0),
        experts=2.0 * moe_layers * model.moe_router_topk * expert,
        shared_experts=2.0 * moe_layers * model.num_shared_experts * expert,
        dense_mlp=2.0 * dense_layers * mlp_weights(h, model.ffn_hidden_size),
        output=2.0 * h * model.vocab_size,
        per_pair=2.0 * model.num_layers * _pair_flops(model),
    )


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
    """Attention parameters of one layer: the projections (`moe_rl.planner.flops.attention_weights`)
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


def _adapter(rank: int, fan_in: int, fan_out: int) -> int:
    """Elements of one LoRA adapter: ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``."""
    return rank * (fan_in + fan_out)


def lora_attention_params(m: ModelConfig, rank: int) -> int:
    """LoRA elements of one layer's attention (`moe_rl.megatron.model.LORA_FIELDS`): GQA's QKV and
    output projections; MLA's query (or query-up), key-value-up and output projections."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.attention == Attention.GQA:
        qkv = (heads + 2 * m.num_key_value_heads) * m.head_dim
        return _adapter(rank, h, qkv) + _adapter(rank, heads * m.head_dim, h)
    q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = _adapter(rank, m.q_lora_rank or h, q_out)
    kv_up = _adapter(rank, m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
    return q + kv_up + _adapter(rank, heads * m.v_head_dim, h)


def lora_mlp_params(hidden: int, ffn: int, rank: int) -> int:
    """LoRA elements of one SwiGLU MLP: gate and up fused in one linear, then down."""
    return _adapter(rank, hidden, 2 * ffn) + _adapter(rank, ffn, hidden)


def lora_param_counts(m: ModelConfig, lora) -> ParamCounts:
    """The trainable parameters of a LoRA run (``lora``: the recipe's `LoraConfig`) by component,
    as `count_params` counts a model's: each target's adapters, the routers with
    ``lora.train_router``, the output layer with ``lora.train_output_layer`` (with tied embeddings,
    the embedding it shares); no norm trains."""
    full, rank, targets = count_params(m), lora.rank, set(lora.targets)
    h = m.hidden_size
    return dataclasses.replace(
        full,
        embedding=full.embedding if lora.train_output_layer and m.tie_word_embeddings else 0,
        lm_head=full.lm_head if lora.train_output_layer else 0,
        final_norm=0,
        attention_per_layer=lora_attention_params(m, rank) if LoraTarget.ATTENTION in targets else 0,
        norms_per_layer=0,
        dense_mlp_per_layer=lora_mlp_params(h, m.ffn_hidden_size, rank)
        if LoraTarget.DENSE_MLP in targets
        else 0,
        expert=lora_mlp_params(h, m.moe_ffn_hidden_size, rank)
        if LoraTarget.EXPERTS in targets and full.expert
        else 0,
        shared_experts_per_layer=(
            lora_mlp_params(h, m.num_shared_experts * m.moe_ffn_hidden_size, rank)  # one MLP of them all
            if LoraTarget.SHARED_EXPERTS in targets and full.shared_experts_per_layer
            else 0
        ),
        router_per_layer=m.hidden_size * m.num_experts
        if lora.train_router
        else 0,  # the expert bias is a buffer
    )
