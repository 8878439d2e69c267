"""Build a Megatron-core ``GPTModel`` Mixture-of-Experts from the recipe's `ModelConfig`.

Two families:

* ``qwen3_moe`` (Qwen3-MoE): GQA attention with per-head RMSNorm on queries and keys
  (``qk_layernorm``), RoPE, SwiGLU experts, no biases, a softmax router. Qwen3 takes the
  softmax over all experts, picks the top-k and (``norm_topk_prob``) renormalizes them; that is
  Megatron's ``moe_router_pre_softmax=False`` (softmax over the top-k logits). Without
  renormalization it is ``moe_router_pre_softmax=True``.
* ``deepseek_v3`` (DeepSeek-V3, Kimi-K2): multi-head latent attention (``MLATransformerConfig``),
  shared experts, sigmoid scores with the aux-loss-free expert bias used for selection only,
  group-limited routing, a routed scaling factor and ``first_k_dense_layers`` dense MLP layers.
  Rotary scaling: plain RoPE or YaRN (`_rope_kwargs`), as in the published configs.

On CUDA with transformer-engine the TE layer specs are used; without transformer-engine (CPU, or
CUDA without it, a configuration Megatron supports) the local specs with the packed SDPA core
attention (`moe_rl.megatron.attention.SDPACoreAttention`). The model is built on the process's
device (`moe_rl.device`): on CUDA Megatron initializes it there (CUDA RNG tracker seeded by
``model_parallel_cuda_manual_seed``), on CPU ``use_cpu_initialization=True`` draws every weight
from the torch CPU generator. Initialization is deterministic per device: the seed is set before
construction.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn.functional as F

from moe_rl.config.modes import Attention, ExpertGemm, Family, LoraTarget, RopeScaling, ScoreFunction
from moe_rl.config.schema import LoraConfig, ModelConfig, ParallelConfig, TrainerConfig
from moe_rl.config.validate import check_rope_scaling
from moe_rl.errors import UserError
from moe_rl.megatron.attention import SDPACoreAttention
from moe_rl.megatron.compat import (
    cuda_available,
    expert_gemm,
    require_process_setup,
    te_available,
    token_dispatcher,
)
from moe_rl.megatron.rules import HF_ARCHITECTURES

log = logging.getLogger(__name__)

FAMILIES = ("qwen3_moe", "deepseek_v3")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """Megatron ``moe_layer_freq`` as a list: 0 for a dense layer, 1 for an MoE layer."""
    if model.num_experts == 0:
        return [0] * model.num_layers
    dense = min(model.first_k_dense_layers, model.num_layers)
    return [0] * dense + [1] * (model.num_layers - dense)


def _check_model(model: ModelConfig) -> None:
    if model.family not in FAMILIES:
        raise ValueError(f"model.family='{model.family}' is not supported; valid: {', '.join(FAMILIES)}")
    if model.num_experts <= 0:
        raise ValueError(
            f"model.num_experts={model.num_experts}: the trainer builds MoE models (>= 1 expert)"
        )
    if not 0 < model.moe_router_topk <= model.num_experts:
        raise ValueError(
            f"model.moe_router_topk={model.moe_router_topk} must be in 1..num_experts={model.num_experts}"
        )
    if (
        model.moe_router_score_function == ScoreFunction.SIGMOID
        and not model.norm_topk_prob
        and model.moe_router_topk > 1
    ):
        raise ValueError(
            "model.norm_topk_prob=false with moe_router_score_function=sigmoid: Megatron-core always "
            "renormalizes sigmoid top-k scores; set norm_topk_prob=true"
        )
    if model.family == Family.DEEPSEEK_V3 and model.attention != Attention.MLA:
        raise ValueError(f"model.family=deepseek_v3 needs model.attention='mla', got '{model.attention}'")
    if model.family == Family.QWEN3_MOE and model.attention != Attention.GQA:
        raise ValueError(f"model.family=qwen3_moe needs model.attention='gqa', got '{model.attention}'")
    check_rope_scaling(model)


def _moe_kwargs(model: ModelConfig, trainer: TrainerConfig) -> dict[str, Any]:
    dispatcher = token_dispatcher(trainer.moe_token_dispatcher_type)
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_layer_freq": moe_layer_pattern(model),
        "moe_router_score_function": str(model.moe_router_score_function),
        "moe_router_pre_softmax": model.moe_router_score_function == ScoreFunction.SOFTMAX
        and not model.norm_topk_prob,
        "moe_router_enable_expert_bias": model.moe_router_enable_expert_bias,
        # The expert bias is a rollout-time balancing device; RL keeps it as loaded.
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": model.moe_router_num_groups,
        "moe_router_group_topk": model.moe_router_group_topk,
        "moe_router_topk_scaling_factor": model.moe_router_topk_scaling_factor,
        "moe_router_load_balancing_type": "aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": model.moe_aux_loss_coeff,
        "moe_router_dtype": "fp32",
        "moe_shared_expert_intermediate_size": (
            model.num_shared_experts * model.moe_ffn_hidden_size if model.num_shared_experts else None
        ),
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": expert_gemm(trainer.expert_gemm) == ExpertGemm.TE,
        "moe_router_fusion": trainer.moe_router_fusion,
        "moe_permute_fusion": False,
        "moe_enable_routing_replay": True,
    }


def _parallel_kwargs(parallel: ParallelConfig) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "sequence_parallel": parallel.sequence_parallel,
    }


def _rope_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The rotary fields of Megatron's ``MLATransformerConfig`` for this model.

    YaRN (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V3 defines it. With s the factor, d the
    rotary head width, L the original context and w_i = rope_theta^(-2i/d) the plain RoPE
    frequencies, frequency i is ``(1 - r_i) w_i / s + r_i w_i``, where r_i ramps linearly from 1
    to 0 between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over L (rounded
    outward); cos and sin are multiplied by ``m(mscale) / m(mscale_all_dim)`` and the softmax
    scale is ``m(mscale_all_dim)^2 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, with
    ``m(a) = 0.1 a ln(s) + 1`` (1 for s <= 1). Megatron-core's ``YarnRotaryEmbedding`` and
    ``MLASelfAttention``, transformers' ``DeepseekV3`` and vLLM's ``DeepseekScalingRotaryEmbedding``
    all compute this. They can differ only where mscale or mscale_all_dim is 0 (transformers then
    multiplies cos and sin by ``m(1)``), which `check_rope_scaling` refuses unless all agree, and
    in HF keys that transformers and vLLM read differently (``attention_factor``, ``truncate``),
    which a recipe cannot set (`model_config_to_hf_config` writes neither).

    Plain RoPE keeps ``rotary_scaling_factor=1``: Megatron's MLA computes its softmax scale from
    that field whatever ``rope_type`` is, and ``m`` of a factor of 1 is 1.
    """
    if model.rope_scaling_type == RopeScaling.NONE:
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0}
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": model.rope_scaling_factor,
        "original_max_position_embeddings": model.rope_original_max_position_embeddings,
        "beta_fast": model.rope_beta_fast,
        "beta_slow": model.rope_beta_slow,
        "mscale": model.rope_mscale,
        "mscale_all_dim": model.rope_mscale_all_dim,
    }


def _mla_kwargs(model: ModelConfig) -> dict[str, Any]:
    return {
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_head_dim": model.qk_nope_head_dim,
        "qk_pos_emb_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "rotary_base": model.rope_theta,
        "qk_layernorm": True,
        **_rope_kwargs(model),
    }


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig | None = None,
    trainer: TrainerConfig | None = None,
):
    """The Megatron ``TransformerConfig`` (``MLATransformerConfig`` for MLA) of a recipe model."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    _check_model(model)
    parallel = parallel or ParallelConfig()
    trainer = trainer or TrainerConfig()
    if trainer.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision='{trainer.precision}'; valid: {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[trainer.precision]
    kwargs: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "ffn_hidden_size": model.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": model.init_std,
        "use_cpu_initialization": not cuda_available(),
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "pipeline_dtype": dtype,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        # Losses are sums divided by a global count (finalize_model_grads(num_tokens=...)), so
        # DistributedDataParallel must sum gradients over data-parallel ranks, not average them.
        "calculate_per_token_loss": True,
        **_parallel_kwargs(parallel),
        **_moe_kwargs(model, trainer),
    }
    if trainer.recompute_activations:
        kwargs |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if model.attention == Attention.MLA:
        return MLATransformerConfig(**kwargs, **_mla_kwargs(model))
    kwargs |= {
        "num_query_groups": model.num_key_value_heads,
        "kv_channels": model.head_dim,
        "qk_layernorm": True,
    }
    return TransformerConfig(**kwargs)


LORA_FIELDS = {
    # MLA's down projections (to the latents) keep none: Megatron's MLA takes them only as its own classes
    LoraTarget.ATTENTION: ("linear_qkv", "linear_proj", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"),
    LoraTarget.DENSE_MLP: ("linear_fc1", "linear_fc2"),
    LoraTarget.EXPERTS: ("linear_fc1", "linear_fc2"),
    LoraTarget.SHARED_EXPERTS: ("linear_fc1", "linear_fc2"),
}  # fmt: skip
"""The linears of each `lora.targets` entry, by their field in Megatron's layer spec."""


def _target_specs(layer) -> dict[LoraTarget, Any]:
    """The submodule spec holding each LoRA target's linears in one layer's spec (those it has)."""
    from megatron.core.transformer.mlp import MLP

    mlp = layer.submodules.mlp
    inner = getattr(mlp, "submodules", None)
    found = {LoraTarget.ATTENTION: layer.submodules.self_attention.submodules}
    if mlp.module is MLP:
        found[LoraTarget.DENSE_MLP] = inner
    for target, field in ((LoraTarget.EXPERTS, "experts"), (LoraTarget.SHARED_EXPERTS, "shared_experts")):
        spec = getattr(inner, field, None)
        if spec is not None and getattr(spec, "submodules", None) is not None:
            found[target] = spec.submodules
    return found


def _add_adapters(block, lora: LoraConfig) -> None:
    """Swap every target linear of ``block``'s layer specs for its LoRA class (`moe_rl.megatron.lora`)."""
    from moe_rl.megatron.lora import lora_classes

    classes = lora_classes(lora)
    for layer in block.layer_specs:
        for target, holder in _target_specs(layer).items():
            if target not in lora.targets:
                continue
            for name in LORA_FIELDS[target]:
                linear = getattr(holder, name, None)
                if linear is None or linear in classes.values():  # none, or a spec shared by layers
                    continue
                if linear not in classes:
                    raise UserError(
                        f"lora.targets={target}: its {name} is {getattr(linear, '__name__', linear)}, not one "
                        "of Megatron's local linears (LoRA adapts ColumnParallelLinear and RowParallelLinear)"
                    )
                setattr(holder, name, classes[linear])


def _layer_spec(config, use_te: bool, gemm: ExpertGemm, lora: LoraConfig | None = None):
    """Megatron's decoder block spec; without transformer-engine, SDPA attention; with
    ``gemm=torch``, the MoE layers' ``SequentialMLP`` becomes `GroupedExperts` (same parameters);
    with ``lora`` (rank > 0), the target linears carry adapters."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.megatron.grouped_experts import GroupedExperts

    block = copy.deepcopy(
        get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    )
    for layer in block.layer_specs:
        if not use_te:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        experts = getattr(getattr(layer.submodules.mlp, "submodules", None), "experts", None)
        if gemm == ExpertGemm.TORCH and experts is not None and experts.module is SequentialMLP:
            experts.module = GroupedExperts
    if lora is not None and lora.rank > 0:
        _add_adapters(block, lora)
    return block


def build_gpt_model(
    model: ModelConfig,
    parallel: ParallelConfig | None = None,
    trainer: TrainerConfig | None = None,
    seed: int = 1234,
    lora: LoraConfig | None = None,
):
    """A Megatron ``GPTModel`` MoE for this pipeline stage, initialized from ``seed``; with ``lora``
    (rank > 0) its target linears carry adapters (`moe_rl.megatron.lora`).

    Megatron's parallel state must be initialized (`moe_rl.megatron.parallel.init_parallel`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    require_process_setup()
    trainer = trainer or TrainerConfig()
    config = transformer_config(model, parallel, trainer)
    use_te = te_available()
    torch.manual_seed(seed)
    if cuda_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config, use_te, expert_gemm(trainer.expert_gemm), lora),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),  # no virtual stages (`megatron.rules`)
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=model.rope_theta,
    )
    if cuda_available():
        gpt = gpt.cuda()
    log.debug("built %s: %d parameters on this rank", model.family, sum(p.numel() for p in gpt.parameters()))
    return gpt


# HF rope_scaling key -> ModelConfig field, for YaRN.
YARN_FIELDS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}


def _qwen3_hf_fields(model: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": [HF_ARCHITECTURES[Family.QWEN3_MOE]],
        "model_type": "qwen3_moe",
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "num_experts": model.num_experts,
        "norm_topk_prob": model.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "attention_bias": False,
    }


def _deepseek_hf_fields(model: ModelConfig) -> dict[str, Any]:
    grouped = model.moe_router_num_groups is not None
    return {
        "architectures": [HF_ARCHITECTURES[Family.DEEPSEEK_V3]],
        "model_type": "deepseek_v3",
        "num_key_value_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_hidden_size,
        "n_routed_experts": model.num_experts,
        "n_shared_experts": model.num_shared_experts,
        "first_k_dense_replace": model.first_k_dense_layers,
        "n_group": model.moe_router_num_groups if grouped else 1,
        "topk_group": model.moe_router_group_topk if grouped else 1,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "norm_topk_prob": model.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "head_dim": model.qk_rope_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
    }


def _rope_hf_fields(model: ModelConfig) -> dict[str, Any]:
    """``rope_scaling`` as the published DeepSeek-V3 / Kimi-K2 configs write it (``type``, read by
    their own modeling code) and with ``rope_type`` (read by transformers and vLLM)."""
    if model.rope_scaling_type == RopeScaling.NONE:
        return {}
    yarn = {key: getattr(model, field) for key, field in YARN_FIELDS.items()}
    return {"rope_scaling": {"type": "yarn", "rope_type": "yarn", **yarn}}


def model_config_to_hf_config(model: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The HF ``config.json`` dict of a recipe model, for `hf_weights.save_hf_checkpoint` and
    engines that load HF folders (vLLM)."""
    _check_model(model)
    family = _qwen3_hf_fields(model) if model.family == Family.QWEN3_MOE else _deepseek_hf_fields(model)
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts_per_tok": model.moe_router_topk,
        "hidden_act": "silu",
        "rope_theta": model.rope_theta,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.init_std,
        "torch_dtype": dtype,
        **_rope_hf_fields(model),
        **family,
    }
