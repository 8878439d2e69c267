"""Model FLOPs of a recipe's model, counted from its shape: the one home of the count that
`moe-rl plan`, the training loop's ``perf/tflops`` and ``perf/mfu``, and `bench/trainer_step.py`
use.

A multiply-add is 2 FLOPs. Counted per token of a forward pass: every product with a weight
matrix (attention projections, GQA or MLA with its low-rank paths; the router; the routed experts
a token is sent to, top-k of them; shared experts; dense MLPs of the first layers; the output
layer), and the attention scores and their weighted sum, which depend on how many keys each query
sees (causal: a sequence of ``s`` tokens has ``s(s+1)/2`` query-key pairs). Norms, activations,
rotary embeddings, softmax and the embedding lookup are left out, as in the usual MFU accounting.
A backward pass is twice its forward; activation recompute is not counted (model FLOPs, not
hardware FLOPs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moe_rl.config.modes import Attention
from moe_rl.config.schema import ModelConfig

BACKWARD_FACTOR = 2.0
"""A backward pass costs twice its forward (gradients of inputs and of weights)."""


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


def model_flops(model: ModelConfig) -> ModelFlops:
    """The forward FLOPs of ``model`` (see the module docstring)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.attention == Attention.MLA:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        rank = model.q_lora_rank
        q = h * rank + rank * heads * qk if rank else h * heads * qk  # low-rank: H -> rank -> heads
        kv = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank * heads * (
            model.qk_nope_head_dim + model.v_head_dim
        )
        attention = q + kv + heads * model.v_head_dim * h
        pair = heads * (qk + model.v_head_dim)
    else:
        d = model.head_dim
        attention = h * heads * d + 2 * h * model.num_key_value_heads * d + heads * d * h
        pair = 2 * heads * d
    gated = 3  # gate, up and down projections
    moe_layers = (
        0 if model.num_experts <= 0 else model.num_layers - min(model.first_k_dense_layers, model.num_layers)
    )
    dense_layers = model.num_layers - moe_layers
    return ModelFlops(
        attention=2.0 * model.num_layers * attention,
        router=2.0 * moe_layers * h * max(model.num_experts, 0),
        experts=2.0 * moe_layers * model.moe_router_topk * gated * h * model.moe_ffn_hidden_size,
        shared_experts=2.0 * moe_layers * model.num_shared_experts * gated * h * model.moe_ffn_hidden_size,
        dense_mlp=2.0 * dense_layers * gated * h * model.ffn_hidden_size,
        output=2.0 * h * model.vocab_size,
        per_pair=2.0 * model.num_layers * pair,
    )
