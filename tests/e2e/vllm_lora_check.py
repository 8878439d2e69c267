"""For test_vllm_lora.py: a LoRA run's syncs into a vLLM engine that loads the adapters through
vLLM's own LoRA (``lora.sync=adapters``), and what vLLM's LoRA layers then hold. An in-process vLLM
engine needs a process with no torch.distributed group, so the trainer's is left before it starts.

    python tests/e2e/vllm_lora_check.py RECIPE OVERRIDE...   # prints what `main` finds, as JSON

1. The trainer's Megatron model of the recipe, with its adapters (every ``B`` made non-zero, as
   after training), written as the Hugging Face folder a run starts its engines from.
2. The torch.distributed group is torn down and a `VLLMEngine` starts in this process on that folder
   with the recipe's settings (`recipe_settings`: vLLM's LoRA on).
3. Two syncs through the engine's receiving side, each of exactly what a trainer rank sends
   (`moe_rl.weight_sync.outgoing.owned` of the `SyncPart` the sender picks): the first the base
   weights as they are and the adapters; then, after the adapters change, the adapters alone.
4. After each, vLLM's LoRA manager activates the adapter as a request naming it would, and every
   LoRA layer of vLLM's model (its fused ``qkv_proj``, ``o_proj``, each expert of the fused MoE) is
   read back: ``B·A`` of each of its slices (vLLM folds the scale into ``B``) against the trainer's
   ``merged − base`` of the HF linear the slice serves.

vLLM's CPU build cannot generate with LoRA on an MoE model (no fused-MoE LoRA kernel), so nothing
is generated here; what vLLM holds in its LoRA layers is what its CUDA kernels compute with.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch


def main(recipe: str, overrides: list[str]) -> dict:
    from moe_rl.config.run_plan import run_plan
    from moe_rl.device import Machine
    from moe_rl.megatron.hf_weights import iter_hf_weights, save_hf_checkpoint
    from moe_rl.megatron.lora import adapted_linears, trains
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel, teardown_parallel
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.quant.recipes import ADAPTER_HF
    from moe_rl.rollout.capabilities import engine_capabilities
    from moe_rl.rollout.engine import WHOLE_MODEL
    from moe_rl.rollout.vllm_engine import VLLMEngine
    from moe_rl.rollout.vllm_settings import recipe_settings
    from moe_rl.weight_sync.outgoing import SyncPart, owned

    # the recipe as on a GPU node (vLLM's CPU build is refused LoRA on MoE layers); the engine runs here
    config = load_checked(
        recipe, [*overrides, "run.device=cuda"], Machine(cuda=True, capability=(9, 0)), paths=False
    )
    init_parallel(WHOLE_MODEL)
    model = build_gpt_model(config.model, WHOLE_MODEL, config.trainer, seed=0, lora=config.lora)
    seeded = torch.Generator().manual_seed(3)

    def train() -> None:  # every adapter moves its linear (a fresh B is zero)
        with torch.no_grad():
            for linear in adapted_linears(model).values():
                linear.lora_b.normal_(0.0, 0.05, generator=seeded)

    def sent(part: SyncPart) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor.clone()) for group in owned(model, part) for name, tensor in group]

    def deltas() -> dict[str, torch.Tensor]:  # the trainer's merged − base, per adapted HF linear
        merged = dict(iter_hf_weights(model))
        base = dict(sent(SyncPart(adapters=True)))
        return {n: merged[n] - base[n] for n in merged if not torch.equal(merged[n], base[n])}

    folder = Path(tempfile.mkdtemp(prefix="lora_vllm_")) / "model"
    save_hf_checkpoint(model, folder, model_config_to_hf_config(config.model, dtype="float32"))
    train()
    first, expected = sent(SyncPart(adapters=True)), [deltas()]
    train()
    second = sent(SyncPart(adapters=True, only=trains(model, config.lora)))
    expected.append(deltas())
    teardown_parallel()

    settings = recipe_settings(config, engine_capabilities("vllm", "cuda"), run_plan(config, "cuda"))
    # what the CPU build cannot do, and nothing LoRA touches, is left to the GPU: device, R3, KSM
    cpu = dataclasses.replace(settings, device="cpu", return_routing=False, return_sampling_mask=False)
    engine = VLLMEngine(folder, cpu, in_process=True)
    out: dict = {"lora": settings.lora is not None, "syncs": []}
    try:
        for version, (named, want) in enumerate(zip((first, second), expected, strict=True), start=1):
            stats = engine.update_weights(named, version)
            held = _held_deltas(engine, expected=set(want))
            errors = {n: float((held[n] - want[n]).abs().max()) for n in want if n in held}
            out["syncs"].append({
                "version": engine.policy_version,
                "label": engine._llm.llm_engine.get_weight_version(),
                "adapters_sent": sum(n.endswith(ADAPTER_HF) for n, _ in named),
                "base_sent": sum(not n.endswith(ADAPTER_HF) for n, _ in named),
                "base_tensors": stats.get("num_tensors", 0.0),
                "adapters_bytes": stats.get("adapters_bytes", 0.0),
                "loras": sorted(engine._llm.llm_engine.list_loras()),
                "request": [engine._adapters.request.lora_name, engine._adapters.request.lora_int_id],
                "folder_left": Path(engine._adapters.request.lora_path).exists(),
                "expected": sorted(want),
                "held": sorted(n for n, d in held.items() if bool(d.abs().max() > 0)),
                "max_error": max(errors.values(), default=None),
                "wrapped": _wrapped(engine),
                "largest": max(float(d.abs().max()) for d in want.values()),
            })  # fmt: skip
    finally:
        engine.shutdown()
    return out


def _held_deltas(engine, expected: set[str]) -> dict[str, torch.Tensor]:
    """HF weight name -> ``B·A`` that vLLM's LoRA layers hold for the engine's adapter, after vLLM's
    LoRA manager activates it (what a request naming it does before a step)."""
    manager = _lora_manager(engine)
    manager.activate_adapter(engine._adapters.ADAPTER_ID)
    slot = manager.lora_index_to_id.index(engine._adapters.ADAPTER_ID)
    packed = getattr(manager.model, "packed_modules_mapping", {})
    out: dict[str, torch.Tensor] = {}
    for module_name, module in manager.modules.items():
        if hasattr(module, "w13_lora_a_stacked"):  # the fused MoE: per expert, w1 / w3 / w2
            prefix = module_name
            pairs = {
                "gate_proj": (module.w13_lora_b_stacked[0], module.w13_lora_a_stacked[0]),
                "up_proj": (module.w13_lora_b_stacked[-1], module.w13_lora_a_stacked[-1]),
                "down_proj": (module.w2_lora_b_stacked[0], module.w2_lora_a_stacked[0]),
            }
            for proj, (b, a) in pairs.items():
                for e in range(b.shape[1]):
                    out[f"{prefix}.{e}.{proj}.weight"] = b[slot, e].float() @ a[slot, e].float()
            continue
        a_stacked, b_stacked = (
            getattr(module, "lora_a_stacked", None),
            getattr(module, "lora_b_stacked", None),
        )
        if not isinstance(a_stacked, tuple) or module_name.split(".")[-1] in ("embed_tokens", "lm_head"):
            continue
        last = module_name.split(".")[-1]
        names = packed.get(last, [last])
        parent = module_name.rsplit(".", 1)[0]
        for sub, a, b in zip(names, a_stacked, b_stacked, strict=True):
            out[f"{parent}.{sub}.weight"] = b[slot, 0].float() @ a[slot, 0].float()
    return out


def _wrapped(engine) -> list[str]:
    """The last parts of the names of the modules vLLM's LoRA wraps."""
    return sorted({name.rsplit(".", 1)[-1] for name in _lora_manager(engine).modules})


def _lora_manager(engine):
    """vLLM's LoRA model manager in the in-process engine's worker."""
    worker = engine._llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    return worker.model_runner.lora_manager._adapter_manager


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))
