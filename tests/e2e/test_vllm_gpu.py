"""vLLM's CUDA build: routed experts, sampling masks, CUDA-IPC weight transfer with the policy
version set at ``finish_weight_update``, online FP8. Marked ``gpu`` (skipped without CUDA) and
skipped where vLLM is not installed (the project's GPU machine has no vLLM wheel): written against
vLLM's documented API and NOT yet run.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.config.schema import QuantConfig
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.tiny_hf import load_state_dict, make_tiny_qwen3_moe
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.rollout.vllm_settings import VllmSettings

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]  # on a GPU machine its skip is a failure like any e2e test

VOCAB = 128
PROMPTS = [[1, 2, 3, 4], [5, 6]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_gpu"), seed=0, vocab_size=VOCAB)


def test_cuda_engine_returns_routing_masks_and_syncs_weights_over_ipc(checkpoint):
    engine = VLLMEngine(
        checkpoint,
        VllmSettings(device="cuda", max_model_len=64, return_routing=True, return_sampling_mask=True),
    )
    try:
        spec = SamplingSpec(temperature=1.0, top_k=8, max_new_tokens=5, n=2, seed=0)
        batch = engine.generate(PROMPTS, spec)
        assert batch.has_routing and batch.has_sampling_mask
        assert (batch.num_moe_layers, batch.topk, batch.num_experts) == (2, 2, 8)
        assert batch.routing_lengths().tolist() == (batch.sequence_lengths() - 1).tolist()
        kept = batch.sampling_mask_offsets.diff()
        assert (kept >= 1).all() and (kept <= 8).all()

        state = load_state_dict(checkpoint)
        greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
        before = engine.generate(PROMPTS, greedy)
        zeroed = dict(state, **{"lm_head.weight": torch.zeros_like(state["lm_head.weight"])})
        engine.update_weights(zeroed.items(), version=1)
        uniform = engine.generate(PROMPTS, SamplingSpec(max_new_tokens=6, seed=1))
        torch.testing.assert_close(
            uniform.rollout_logp, torch.full_like(uniform.rollout_logp, -math.log(VOCAB)), atol=2e-2, rtol=0
        )
        assert uniform.token_versions().eq(1).all()
        engine.update_weights(state.items(), version=2)
        assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, before.response_ids)
    finally:
        engine.shutdown()


def test_cuda_engine_rolls_out_with_online_block_fp8(tmp_path):
    path = make_tiny_qwen3_moe(
        tmp_path / "fp8", seed=0, vocab_size=256, hidden_size=256, moe_intermediate_size=128
    )
    quant = QuantConfig(name="fp8_block128", method="fp8", granularity="block", block_size=128)
    engine = VLLMEngine(path, VllmSettings(device="cuda", quant=quant, max_model_len=64))
    try:
        batch = engine.generate(PROMPTS, SamplingSpec(max_new_tokens=4, n=2, seed=0))
        assert batch.quant_recipe == "fp8_block128"
        assert torch.isfinite(batch.rollout_logp).all() and (batch.rollout_logp <= 0).all()
        engine.update_weights(load_state_dict(path).items(), version=1)
        assert engine.generate(PROMPTS, SamplingSpec(max_new_tokens=4)).token_versions().eq(1).all()
    finally:
        engine.shutdown()
