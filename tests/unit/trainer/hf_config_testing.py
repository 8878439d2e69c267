"""A Hugging Face ``config.json`` dict (Qwen3-MoE, DeepSeek-V3, Kimi-K2) read as the recipe's
`ModelConfig`: how the trainer tests build the Megatron twin of a transformers model, and read the
published configs. The library goes the other way only (`model_config_to_hf_config`)."""

from __future__ import annotations

from typing import Any

from moe_rl.config.modes import Attention, RopeScaling
from moe_rl.config.schema import ModelConfig
from moe_rl.config.validate import check_rope_scaling
from moe_rl.megatron.model import YARN_FIELDS


def _hf_get(cfg: dict, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _qwen3_fields(cfg: dict) -> dict[str, Any]:
    decoder_step = cfg.get("decoder_sparse_step", 1)
    mlp_only = cfg.get("mlp_only_layers") or []
    if decoder_step != 1 or mlp_only:
        raise ValueError(
            f"Qwen3-MoE config with decoder_sparse_step={decoder_step}, mlp_only_layers={mlp_only}: "
            "only all-MoE layer layouts are supported"
        )
    heads = cfg["num_attention_heads"]
    return {
        "family": "qwen3_moe",
        "attention": "gqa",
        "num_key_value_heads": _hf_get(cfg, "num_key_value_heads", default=heads),
        "head_dim": _hf_get(cfg, "head_dim", default=cfg["hidden_size"] // heads),
        "ffn_hidden_size": _hf_get(cfg, "intermediate_size", default=cfg["moe_intermediate_size"]),
        "num_experts": _hf_get(cfg, "num_experts", "num_local_experts"),
        "moe_router_topk": cfg["num_experts_per_tok"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_router_score_function": "softmax",
        "moe_aux_loss_coeff": 0.0,
    }


def _deepseek_fields(cfg: dict) -> dict[str, Any]:
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"DeepSeek-V3 config scoring_func={scoring!r}: only 'sigmoid' is supported")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"DeepSeek-V3 config topk_method={method!r}: only 'noaux_tc' is supported")
    groups = cfg.get("n_group")
    topk, group_topk = cfg["num_experts_per_tok"], cfg.get("topk_group")
    if groups and groups > 1 and topk // group_topk != 2:
        # DeepSeek scores a group by its top-2 experts; Megatron by its top-(topk/group_topk).
        raise ValueError(
            f"DeepSeek-V3 config num_experts_per_tok={topk}, topk_group={group_topk}: Megatron scores an "
            f"expert group by its top-{topk // group_topk} experts, DeepSeek by its top-2; "
            "num_experts_per_tok / topk_group must be 2"
        )
    return {
        "family": "deepseek_v3",
        "attention": "mla",
        "num_key_value_heads": cfg["num_attention_heads"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_experts": cfg["n_routed_experts"],
        "moe_router_topk": cfg["num_experts_per_tok"],
        "first_k_dense_layers": cfg.get("first_k_dense_replace", 0),
        "num_shared_experts": cfg.get("n_shared_experts") or 0,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups and groups > 1 else None,
        "moe_router_group_topk": cfg.get("topk_group") if groups and groups > 1 else None,
        "moe_router_topk_scaling_factor": cfg.get("routed_scaling_factor"),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
    }


HF_MODEL_TYPES = {
    "qwen3_moe": _qwen3_fields,
    "deepseek_v3": _deepseek_fields,
    "kimi_k2": _deepseek_fields,
}


_ROPE_NAME_KEYS = ("type", "rope_type", "rope_theta")


def _rope_fields(cfg: dict, attention: str) -> dict[str, Any]:
    """``rope_theta`` and the YaRN fields of a HF config: ``rope_scaling`` (published configs) or
    ``rope_parameters`` (written by transformers >= 5), keys as in `YARN_FIELDS`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(_hf_get(cfg, "rope_theta", default=params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind == "default":
        return {"rope_theta": theta}
    if kind != RopeScaling.YARN or attention != Attention.MLA:
        raise ValueError(
            f"HF config rope scaling {kind!r} with model_type={cfg.get('model_type')!r} is not supported; "
            f"valid: plain RoPE, or 'yarn' for MLA models (deepseek_v3, kimi_k2); rope_scaling={scaling}"
        )
    unknown = set(scaling) - set(YARN_FIELDS) - set(_ROPE_NAME_KEYS) - {"truncate"}
    missing = [key for key in ("factor", "original_max_position_embeddings") if scaling.get(key) is None]
    if unknown or missing or scaling.get("truncate", True) is not True:
        raise ValueError(
            f"HF config yarn rope_scaling={scaling}: unsupported keys {sorted(unknown)}, missing {missing}; "
            f"valid keys: {', '.join([*_ROPE_NAME_KEYS, *YARN_FIELDS])}, truncate=true"
        )
    if scaling.get("mscale") is None and scaling.get("mscale_all_dim"):
        raise ValueError(
            f"HF config yarn rope_scaling={scaling}: mscale_all_dim without mscale scales the rotary cos/sin "
            "by m(1) in transformers and by m(1)/m(mscale_all_dim) in vLLM; set mscale explicitly"
        )
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    yarn = {field: _hf_get(scaling, key, default=defaults.get(key)) for key, field in YARN_FIELDS.items()}
    return {"rope_theta": theta, "rope_scaling_type": "yarn", **yarn}


def hf_config_to_model_config(cfg: dict) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face ``config.json`` dict (Qwen3-MoE, DeepSeek-V3, Kimi-K2).

    Raises ValueError naming the field for architectures or options the trainer cannot express
    (other model types, rope scaling other than YaRN on MLA, partial MoE layouts, softmax
    DeepSeek routers).
    """
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"HF config model_type={model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    fields = HF_MODEL_TYPES[model_type](cfg)
    model = ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=cfg.get("initializer_range", 0.02),
        **_rope_fields(cfg, fields["attention"]),
        **fields,
    )
    check_rope_scaling(model)
    return model
