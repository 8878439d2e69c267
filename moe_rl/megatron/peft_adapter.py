"""A LoRA model's adapters as a PEFT-style adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``) over the Hugging Face names of its base model, which vLLM loads
through its own LoRA support (``LoRARequest``) and PEFT loads onto the HF model.

Each adapted Megatron linear (`moe_rl.megatron.lora`) becomes the adapters of the HF linears it
fuses (`moe_rl.megatron.hf_weights`): ``ΔW = s·B·A`` of a fused weight is, row block by row block,
the ΔW of each HF weight, so a fused QKV's ``B`` splits into the query, key and value rows (by the
same grouped layout as the weight) and a gate/up pair's into halves, each HF linear keeping the
whole ``A``. The scale is PEFT's ``lora_alpha / r``, the recipe's ``alpha / rank``. Routed experts
become one adapter per expert (``mlp.experts.<e>.gate_proj``...), vLLM's per-expert layout.

The adapters are read from a whole model (one rank: the export builds one); the base weights they
apply to are the model's frozen weights (`drop_adapters`: exported with ``--lora base``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from moe_rl.config.schema import LoraConfig
from moe_rl.quant.recipes import ADAPTER_HF

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter file."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """PEFT name -> tensor: ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of every HF linear
    an adapter covers, for a model held whole by this rank (the adapters as a sync carries them,
    `peft_tensors`)."""
    from moe_rl.megatron.hf_weights import _unwrap, iter_hf_weight_groups
    from moe_rl.megatron.lora import is_adapter

    config = _unwrap(model).config
    if (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.expert_model_parallel_size) != (1, 1, 1):  # fmt: skip
        raise ValueError(
            "the adapter folder is written from a model held whole by one rank (TP = PP = EP = 1)"
        )
    groups = iter_hf_weight_groups(model, adapters=True, part=is_adapter)
    return peft_tensors(piece for _, pieces in groups for piece in pieces)


def peft_tensors(named: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """PEFT name -> tensor of adapters under the HF names a sync gives them (`hf_weights`): a fused
    linear's ``A`` comes once, under its first HF linear, and each HF linear gets its own ``B`` and
    a copy of that ``A`` (`hf_weights.shared_a_module`). Raises on a tensor that is no adapter, a
    ``B`` without its ``A`` or an ``A`` no ``B`` uses."""
    from moe_rl.megatron.hf_weights import shared_a_module

    a_of: dict[str, Tensor] = {}
    b_of: dict[str, Tensor] = {}
    for name, tensor in named:
        if name.endswith(ADAPTER_HF[0]):
            a_of[name.removesuffix(ADAPTER_HF[0])] = tensor
        elif name.endswith(ADAPTER_HF[1]):
            b_of[name.removesuffix(ADAPTER_HF[1])] = tensor
        else:
            raise ValueError(
                f"{name!r} is not a LoRA adapter tensor (its name ends in neither of {ADAPTER_HF})"
            )
    out: dict[str, Tensor] = {}
    shared_of = {module: shared_a_module(module) for module in b_of}
    for module, b in b_of.items():
        shared = shared_of[module]
        if shared not in a_of:
            raise ValueError(f"the adapter of {module!r} came without its A ({shared}{ADAPTER_HF[0]})")
        out[f"{PEFT_PREFIX}{module}{ADAPTER_HF[0]}"] = a_of[shared].detach().cpu().contiguous().clone()
        out[f"{PEFT_PREFIX}{module}{ADAPTER_HF[1]}"] = b.detach().cpu().contiguous().clone()
    unused = sorted(set(a_of) - set(shared_of.values()))
    if unused:
        raise ValueError(f"adapter A without a B: {unused[:3]}")
    return out


def target_modules(tensors: dict[str, Tensor]) -> list[str]:
    """The HF linear names the adapters cover, by their last part (``q_proj``, ``gate_proj``...)."""
    return sorted({name.split(".")[-3] for name in tensors})


def adapter_config(lora: LoraConfig, tensors: dict[str, Tensor], base: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for ``tensors`` (``base``: the base model's folder, if any)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules(tensors),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(model: torch.nn.Module, lora: LoraConfig, folder: str | Path, base: str | None) -> list[str]:
    """Write the adapter folder of ``model`` into ``folder``; returns the target modules."""
    return write_adapter(adapter_tensors(model), lora, folder, base)


def write_adapter(
    tensors: dict[str, Tensor], lora: LoraConfig, folder: str | Path, base: str | None
) -> list[str]:
    """Write PEFT-named ``tensors`` (`peft_tensors`) as an adapter folder; returns the target modules."""
    from safetensors.torch import save_file

    if not tensors:
        raise ValueError("the model has no adapters (lora.rank is 0)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(lora, tensors, base)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config["target_modules"]


def drop_adapters(model: torch.nn.Module) -> None:
    """Zero every adapter's ``B``: the model computes its frozen base weights (``W + s·0·A = W``),
    and its HF weights (`moe_rl.megatron.hf_weights`, which merge adapters) are the base's exactly."""
    from moe_rl.megatron.hf_weights import _unwrap
    from moe_rl.megatron.lora import adapted_linears

    with torch.no_grad():
        for linear in adapted_linears(_unwrap(model)).values():
            linear.lora_b.zero_()
