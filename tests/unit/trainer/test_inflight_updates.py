"""In-flight weight updates (`rollout.inflight_updates`): a sync that lands while the Megatron engine
decodes parks the generation at its next token boundary (`SyncGate`), loads, and the generation goes
on with the new weights; each response records the version that sampled each of its tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from trainer_testing import tiny_recipe

from moe_rl.data.validate import validate
from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.megatron.model import build_gpt_model
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine

SWITCH = 3
"""The sync lands at the third token boundary: after each response's third token."""


def test_a_sync_during_decoding_switches_the_weights_at_a_token_boundary():
    config = tiny_recipe("rollout.quant=bf16")
    old = build_gpt_model(config.model, config.parallel, config.trainer, seed=5)
    new = build_gpt_model(config.model, config.parallel, config.trainer, seed=6)
    spec = SamplingSpec(max_new_tokens=8, n=2, seed=11)
    prompts = [[3, 4, 5], [7, 8]]

    steady = MegatronEngine(config)  # version 0 throughout
    steady.update_weights(iter_hf_weights(old), version=0)
    expected = steady.generate(prompts, spec)

    engine = MegatronEngine(config)
    engine.update_weights(iter_hf_weights(old), version=0)
    boundaries, syncs = 0, []
    original = engine.gate.boundary

    def boundary() -> bool:
        nonlocal boundaries
        boundaries += 1
        if boundaries == SWITCH:  # a trainer's sync arrives from another thread (as Ray runs it)
            sync = threading.Thread(target=lambda: engine.update_weights(iter_hf_weights(new), version=1))
            sync.start()
            syncs.append(sync)
            deadline = time.monotonic() + 60
            while not engine.gate._syncing:
                assert time.monotonic() < deadline, "the sync never reached the engine's gate"
                time.sleep(0.001)
        return original()

    engine.gate.boundary = boundary
    batch = engine.generate(prompts, spec)
    syncs[0].join(timeout=60)
    assert engine.gate.inflight == 1 and batch.policy_version == 1
    validate(batch, vocab_size=config.model.vocab_size)
    for i in range(batch.num_samples):
        got, before = batch.sample(i), expected.sample(i)
        assert got.version_spans == [(0, 0), (SWITCH, 1)]
        assert torch.equal(got.response_ids[:SWITCH], before.response_ids[:SWITCH])  # the old weights'
        assert torch.equal(got.rollout_logp[:SWITCH], before.rollout_logp[:SWITCH])
        # the next token's log-prob is the new weights' (same sampler state, other model)
        assert got.rollout_logp[SWITCH] != pytest.approx(float(before.rollout_logp[SWITCH]), abs=1e-6)
    versions = batch.token_versions().view(batch.num_samples, -1)
    assert versions[:, :SWITCH].eq(0).all() and versions[:, SWITCH:].eq(1).all()
    again = engine.generate(prompts, spec)  # no sync in flight: one version, the new one
    assert all(again.sample(i).version_spans == [(0, 1)] for i in range(again.num_samples))
