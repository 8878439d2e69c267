"""A LoRA run whose vLLM engines load the adapters through vLLM's own LoRA (``lora.sync=adapters``):
the recipe as on a GPU node, its two kinds of sync (the base and the adapters; the adapters alone)
into a real `VLLMEngine`, and what vLLM's LoRA layers hold after each, against the trainer's merged
weights (`vllm_lora_check.py`: the engine in this process, once the trainer's torch.distributed
group is left)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_vllms_lora_layers_hold_the_trainers_adapters_after_each_sync():
    from tests.e2e.vllm_lora_check import main

    overrides = ["lora.rank=4", "lora.alpha=16", "lora.sync=adapters", "lora.targets=[attention,experts]"]
    found = main(str(REPO / "recipes" / "tiny_moe_vllm.yaml"), overrides)
    assert found["lora"]
    first, second = found["syncs"]
    # the first sync brings the base and the adapters, the second the adapters alone; both are loaded
    # as the one adapter every later request names, and the engine takes the sync's version
    assert first["base_sent"] > 0 and first["base_tensors"] == first["base_sent"]
    assert second["base_sent"] == 0 and second["base_tensors"] == 0
    for version, sync in enumerate((first, second), start=1):
        assert sync["version"] == version and sync["label"] == str(version)
        assert sync["loras"] == [1] and sync["request"] == [f"policy_v{version}", 1]
        assert not sync["folder_left"]  # vLLM read the adapter folder in add_lora; it is removed then
        assert sync["adapters_sent"] > 0 and sync["adapters_bytes"] > 0
        # every adapted HF linear (q, k, v, o, each expert's gate, up and down) moved, and vLLM's LoRA
        # layers hold exactly the trainer's (alpha/r)·B·A for each: vLLM folds the scale into B
        layers, experts = 2, 8
        assert len(sync["expected"]) == layers * (4 + 3 * experts)
        assert sync["held"] == sync["expected"]
        # vLLM wraps only the targets' modules (not the embedding, the routers or the head)
        assert sync["wrapped"] == ["experts", "o_proj", "qkv_proj"]
        assert sync["max_error"] < 1e-6 * sync["largest"] + 1e-7
