"""`VllmAdapters` (``lora.sync=adapters`` into vLLM engines): what a sync's buckets keep aside for
vLLM's own LoRA and what they pass on as base weights, a sync that brought no adapters, and the
modules vLLM's LoRA wraps for each ``lora.targets`` kind (`vllm_lora_modules`). The adapters'
load into a running engine is `tests/e2e/test_vllm_lora.py`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.config.schema import LoraConfig
from moe_rl.rollout.vllm_adapters import VllmAdapters
from moe_rl.rollout.vllm_settings import vllm_lora_modules

O_PROJ = "model.layers.0.self_attn.o_proj"


def _adapters() -> VllmAdapters:
    adapters = VllmAdapters(LoraConfig(rank=4, alpha=16.0, sync="adapters"), "base")
    adapters.begin()
    return adapters


def test_a_buckets_adapters_are_kept_as_copies_and_its_base_weights_pass_on():
    adapters = _adapters()
    a, b, weight = torch.ones(4, 8), torch.full((16, 4), 2.0), torch.ones(16, 8)
    bucket = [(f"{O_PROJ}.lora_A.weight", a), (f"{O_PROJ}.weight", weight), (f"{O_PROJ}.lora_B.weight", b)]
    passed = list(adapters.take(bucket))
    assert len(passed) == 1 and passed[0][0] == f"{O_PROJ}.weight" and passed[0][1] is weight
    a.zero_(), b.zero_()  # the bucket's memory takes the next message
    kept = adapters._tensors
    assert sorted(kept) == [f"{O_PROJ}.lora_A.weight", f"{O_PROJ}.lora_B.weight"]
    assert torch.equal(kept[f"{O_PROJ}.lora_A.weight"], torch.ones(4, 8))
    assert torch.equal(kept[f"{O_PROJ}.lora_B.weight"], torch.full((16, 4), 2.0))
    # one sync brings each adapter once
    with pytest.raises(
        ValueError, match=r"weight 'model.layers.0.self_attn.o_proj.lora_A.weight' arrived twice"
    ):
        list(adapters.take([(f"{O_PROJ}.lora_A.weight", a)]))


def test_a_sync_into_an_engine_with_lora_must_bring_adapters():
    adapters = _adapters()
    assert list(adapters.take([(f"{O_PROJ}.weight", torch.ones(16, 8))]))  # base weights only
    with pytest.raises(ValueError, match="weight sync incomplete: .* with LoRA adapters brought none"):
        adapters.load(None, 1)  # (refused before vLLM is asked)
    assert adapters.request is None and not adapters.holds_base


@pytest.mark.parametrize(
    ("targets", "modules"),
    [
        (["attention"], ["o_proj", "qkv_proj"]),
        (["dense_mlp"], ["down_proj", "gate_up_proj"]),
        (["experts"], ["experts"]),
        (["shared_experts"], ["down_proj", "gate_up_proj"]),
        (["attention", "dense_mlp", "experts", "shared_experts"],
         ["down_proj", "experts", "gate_up_proj", "o_proj", "qkv_proj"]),
    ],
)  # fmt: skip
def test_vllm_wraps_the_fused_modules_of_each_target(targets, modules):
    """vLLM's names: its fused QKV and gate/up linears, its fused MoE; dense MLPs and shared experts
    share theirs."""
    assert vllm_lora_modules(LoraConfig(rank=4, targets=targets, sync="adapters")) == modules
