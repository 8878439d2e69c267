"""A tiny Qwen3-MoE Hugging Face checkpoint, made locally (no download).

Rollout engines load a Hugging Face folder; tests, benches and tiny recipes make one here from a
seed with ``transformers`` (``Qwen3MoeConfig`` -> ``Qwen3MoeForCausalLM``, random init,
``save_pretrained`` as safetensors). No tokenizer is written: prompts are token ids and vLLM runs
with ``skip_tokenizer_init=True``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.config.modes import Attention, Family

if TYPE_CHECKING:
    from moe_rl.config.schema import ModelConfig

logger = logging.getLogger(__name__)

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
"""Keyword arguments of ``Qwen3MoeConfig`` for the tiny test model (vocab 128, 2 layers, 8 experts,
top-2); any of them can be overridden."""


def qwen3_moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """``Qwen3MoeConfig`` keyword arguments mirroring a recipe's ``model`` section (qwen3_moe only)."""
    if model.family != Family.QWEN3_MOE or model.attention != Attention.GQA:
        raise ValueError(
            f"model.family='{model.family}' / model.attention='{model.attention}': a Hugging Face "
            "checkpoint can be made from config only for family=qwen3_moe with attention=gqa; "
            "set model.hf_path to an existing checkpoint for other families"
        )
    if model.num_experts <= 0:
        raise ValueError(f"model.num_experts={model.num_experts}: qwen3_moe needs experts (> 0)")
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "norm_topk_prob": model.norm_topk_prob,
        "mlp_only_layers": list(range(model.first_k_dense_layers)),
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.init_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
    }


def make_tiny_qwen3_moe(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    eos_token_id: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a randomly initialized Qwen3-MoE checkpoint (config + safetensors) to ``out_dir``.

    ``overrides`` replace entries of ``TINY_DEFAULTS`` (``Qwen3MoeConfig`` keyword arguments).
    With ``eos_token_id=None`` generation stops only at ``max_tokens``. The same seed and
    arguments give bit-identical weights. Returns the folder.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    unknown = (
        set(overrides) - set(TINY_DEFAULTS) - {"mlp_only_layers", "rope_parameters", "decoder_sparse_step"}
    )
    if unknown:
        raise ValueError(
            f"make_tiny_qwen3_moe: unknown overrides {sorted(unknown)}; valid: {sorted(TINY_DEFAULTS)}"
        )
    kwargs = {**TINY_DEFAULTS, **overrides}
    config = Qwen3MoeConfig(
        **kwargs, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, dtype=dtype
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config).to(torch_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    logger.info(
        "tiny Qwen3-MoE (vocab %d, %d layers, %d experts, top-%d, %s) written to %s",
        kwargs["vocab_size"],
        kwargs["num_hidden_layers"],
        kwargs["num_experts"],
        kwargs["num_experts_per_tok"],
        dtype,
        out,
    )
    return out


def load_state_dict(path: str | Path) -> dict[str, Any]:
    """The checkpoint's tensors by Hugging Face name (all safetensors files in the folder)."""
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    for file in files:
        state.update(load_file(file))
    return state
