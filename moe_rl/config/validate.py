"""The recipe's own consistency: choices, types, positive sizes, batch shapes, correction bands.
They run before any heavy import, so a bad recipe fails in well under a second; every error names
the field, its value and what would be valid.

The rules of the components that run a recipe (the trainer's layout, the engine's capabilities,
placement) live with those components; `moe_rl.validation` calls all of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_rl.config.loader import ConfigError
from moe_rl.config.schema import ModelConfig, RecipeConfig
from moe_rl.device import RUN_DEVICES

# The recipe vocabulary. `moe_rl.algo.registry` maps the algorithm names to functions; a test
# keeps the two in step (this module must not import torch).
CHOICES: dict[str, tuple[str, ...]] = {
    "run.mode": ("sync", "async", "offline"),
    "run.device": RUN_DEVICES,
    "model.family": ("qwen3_moe", "deepseek_v3"),
    "model.attention": ("gqa", "mla"),
    "model.moe_router_score_function": ("softmax", "sigmoid"),
    "model.rope_scaling_type": ("none", "yarn"),
    "rollout.engine": ("megatron", "vllm"),
    "quant.method": ("none", "fp8", "int8", "int4_awq", "nvfp4"),
    "quant.granularity": ("tensor", "channel", "block"),
    "algo.objective": ("ppo_clip", "gspo", "gspo_token", "cispo", "reinforce", "espo", "dgo"),
    "algo.advantage": ("grpo", "dr_grpo", "rloo"),
    "algo.aggregation": (
        "token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
    ),
    "algo.policy_mode": ("decoupled", "bypass"),
    "algo.routing_replay": ("off", "r2", "r3"),
    "algo.kl.estimator": ("k1", "k2", "k3", "abs", "k3_is"),
    "algo.corrections.tis.mode": ("off", "token", "seq"),
    "algo.corrections.rejection.divergence": ("k1", "k2", "k3"),
    "algo.corrections.rejection.aggregation": ("token", "seq_sum", "seq_mean", "seq_max"),
    "trainer.lr_decay_style": ("constant", "linear", "cosine"),
    "trainer.precision": ("fp32", "bf16"),
    "trainer.moe_token_dispatcher_type": ("alltoall", "allgather"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}


def _get(config: RecipeConfig, path: str) -> object:
    value: object = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choices(config: RecipeConfig) -> None:
    for path, valid in CHOICES.items():
        value = _get(config, path)
        _require(value in valid, f"{path}={value!r} is not one of: {', '.join(valid)}")


def _check_positive(config: RecipeConfig, paths: Iterable[str], strict: bool = True) -> None:
    for path in paths:
        value = _get(config, path)
        ok = value > 0 if strict else value >= 0  # type: ignore[operator]
        _require(ok, f"{path}={value!r} must be {'> 0' if strict else '>= 0'}")


def _check_model(config: RecipeConfig) -> None:
    m = config.model
    _check_positive(config, ("model.vocab_size", "model.hidden_size", "model.num_layers"))
    _require(
        m.num_experts == 0 or 1 <= m.moe_router_topk <= m.num_experts,
        f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts={m.num_experts}]",
    )
    _require(
        m.first_k_dense_layers < m.num_layers or m.num_experts == 0,
        f"model.first_k_dense_layers={m.first_k_dense_layers} leaves no MoE layer "
        f"(model.num_layers={m.num_layers})",
    )
    if m.attention == "gqa":
        _require(
            m.num_attention_heads % m.num_key_value_heads == 0,
            f"model.num_attention_heads={m.num_attention_heads} must be divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads}",
        )
    if (m.moe_router_num_groups is None) != (m.moe_router_group_topk is None):
        raise ConfigError(
            "model.moe_router_num_groups and model.moe_router_group_topk are set together "
            f"(got {m.moe_router_num_groups} and {m.moe_router_group_topk})"
        )
    if m.moe_router_num_groups:
        _require(
            m.num_experts % m.moe_router_num_groups == 0,
            f"model.num_experts={m.num_experts} must be divisible by "
            f"model.moe_router_num_groups={m.moe_router_num_groups}",
        )
    check_rope_scaling(m)


def check_rope_scaling(m: ModelConfig) -> None:
    """The rotary scaling fields of a model section; also run by the model builder.

    YaRN is accepted only where transformers (the reference the HF logits tests compare with),
    vLLM and Megatron-core compute the same cos/sin scale. With m(a) = 0.1 a ln(s) + 1, vLLM and
    Megatron always use m(mscale) / m(mscale_all_dim); transformers uses that ratio only when both
    are non-zero and m(1) otherwise. They agree when both are non-zero, or when mscale=1 and
    mscale_all_dim=0.
    """
    if m.rope_scaling_type == "none":
        return
    _require(
        m.rope_scaling_type == "yarn",
        f"model.rope_scaling_type={m.rope_scaling_type!r} is not one of: none, yarn",
    )
    _require(
        m.attention == "mla",
        f"model.rope_scaling_type=yarn needs model.attention=mla (got {m.attention!r}): the trainer applies "
        "YaRN in multi-latent attention only (DeepSeek-V3, Kimi-K2); use model.rope_scaling_type=none",
    )
    _require(m.rope_scaling_factor > 0, f"model.rope_scaling_factor={m.rope_scaling_factor} must be > 0")
    original = m.rope_original_max_position_embeddings
    _require(
        original is not None and original > 0,
        f"model.rope_original_max_position_embeddings={original} must be set (> 0) with "
        "model.rope_scaling_type=yarn",
    )
    _require(m.rope_beta_fast > 0, f"model.rope_beta_fast={m.rope_beta_fast} must be > 0")
    _require(m.rope_beta_slow > 0, f"model.rope_beta_slow={m.rope_beta_slow} must be > 0")
    _require(
        m.rope_mscale != 0 and (m.rope_mscale_all_dim != 0 or m.rope_mscale == 1),
        f"model.rope_mscale={m.rope_mscale} with model.rope_mscale_all_dim={m.rope_mscale_all_dim}: "
        "transformers and vLLM scale the rotary cos/sin differently here; valid: both non-zero, "
        "or rope_mscale=1 with rope_mscale_all_dim=0",
    )


def _check_batches(config: RecipeConfig) -> None:
    r = config.rollout
    _check_positive(config, ("rollout.batch_size", "rollout.group_size", "rollout.max_new_tokens"))
    _check_positive(config, ("trainer.num_mini_batches", "rollout.temperature", "rollout.sync_bucket_mb"))
    _check_positive(config, ("rollout.num_engines", "rollout.tensor_parallel_size"))
    _check_positive(
        config,
        (
            "parallel.trainer_world_size", "parallel.tensor_model_parallel_size",
            "parallel.pipeline_model_parallel_size", "parallel.expert_model_parallel_size",
            "parallel.expert_tensor_parallel_size", "parallel.context_parallel_size",
        ),
    )  # fmt: skip
    _require(
        r.batch_size % r.group_size == 0,
        f"rollout.batch_size={r.batch_size} must be divisible by rollout.group_size={r.group_size}",
    )
    _require(
        config.algo.advantage != "rloo" or r.group_size >= 2,
        f"algo.advantage=rloo needs rollout.group_size >= 2 (got {r.group_size})",
    )
    _require(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    _require(r.top_k == -1 or r.top_k > 0, f"rollout.top_k={r.top_k} must be -1 (off) or > 0")
    longest = config.data.max_prompt_len + r.max_new_tokens
    _require(
        longest <= config.model.max_position_embeddings,
        f"data.max_prompt_len + rollout.max_new_tokens = {longest} exceeds "
        f"model.max_position_embeddings={config.model.max_position_embeddings}",
    )


def _check_algo(config: RecipeConfig) -> None:
    a, c = config.algo, config.algo.corrections
    if a.objective == "espo":
        _require(0 < a.espo_rho < 1, f"algo.espo_rho={a.espo_rho} must be in (0, 1)")
        _require(a.espo_num_groups >= 1, f"algo.espo_num_groups={a.espo_num_groups} must be >= 1")
    _require(0 <= a.clip_eps_low < 1, f"algo.clip_eps_low={a.clip_eps_low} must be in [0, 1)")
    _require(a.clip_eps_high >= 0, f"algo.clip_eps_high={a.clip_eps_high} must be >= 0")
    _require(
        0 <= c.icepop.low < c.icepop.high,
        f"algo.corrections.icepop: need 0 <= low < high (got {c.icepop.low}, {c.icepop.high})",
    )
    _require(
        c.rejection.low < c.rejection.high,
        f"algo.corrections.rejection: need low < high (got {c.rejection.low}, {c.rejection.high})",
    )
    _require(c.tis.cap > 0, f"algo.corrections.tis.cap={c.tis.cap} must be > 0")
    if a.routing_replay != "off":
        _require(
            config.model.num_experts > 0,
            f"algo.routing_replay={a.routing_replay} needs an MoE model (model.num_experts=0)",
        )
    if a.routing_replay == "r3":
        _require(
            config.rollout.return_routing,
            "algo.routing_replay=r3 replays the engine's routing: set rollout.return_routing=true",
        )
    if c.keep_sampling_mask:
        _require(
            config.rollout.return_sampling_mask,
            "algo.corrections.keep_sampling_mask=true needs rollout.return_sampling_mask=true",
        )
    _require(
        (a.objective == "dgo") == (config.run.mode == "offline"),
        f"algo.objective={a.objective} with run.mode={config.run.mode}: DGO is the offline objective "
        "(run.mode=offline) and offline runs train DGO",
    )
    if config.run.mode == "offline":
        _require(
            a.routing_replay != "r3" and not c.keep_sampling_mask,
            "run.mode=offline trains on stored trajectories: use algo.routing_replay=off|r2 and "
            "algo.corrections.keep_sampling_mask=false",
        )
        _require(
            config.data.offline_batches > 0,
            f"data.offline_batches={config.data.offline_batches} must be > 0",
        )


def _check_quant(config: RecipeConfig) -> None:
    q = config.quant
    _require(
        q.name == config.rollout.quant,
        f"quant.name={q.name!r} differs from rollout.quant={config.rollout.quant!r}: "
        "switch recipes with rollout.quant=NAME",
    )
    _require(q.block_size > 0, f"quant.block_size={q.block_size} must be > 0")
    _require(q.calib_tokens > 0, f"quant.calib_tokens={q.calib_tokens} must be > 0")


def validate_recipe(config: RecipeConfig) -> None:
    """Run every cross-field check; raise `ConfigError` on the first failure."""
    _check_choices(config)
    _check_model(config)
    _check_batches(config)
    _check_algo(config)
    _check_quant(config)
