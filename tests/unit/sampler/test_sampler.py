"""The Megatron engine's sampler follows vLLM's sampling semantics."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout.sampler import process_logits, sample


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 0.9), (0.7, 5, 1.0), (1.3, 8, 0.8), (1.0, 1, 1.0), (1.0, 30, 0.3), (0.5, -1, 0.05)],
    ids=["top-p", "top-k", "k-then-p", "greedy-k1", "k-wide-p-narrow", "tiny-p"],
)
def test_processing_matches_vllm(temperature, top_k, top_p):
    vllm_sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    apply_top_k_top_p_pytorch = vllm_sampler.apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 40, generator=g) * 3
    ours = process_logits(logits, temperature, top_k, top_p)
    k = None if top_k == -1 else torch.full((16,), top_k)
    p = None if top_p >= 1 else torch.full((16,), top_p)
    theirs = apply_top_k_top_p_pytorch((logits / temperature).clone(), k, p, allow_cpu_sync=False)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours.log_softmax(-1), theirs.log_softmax(-1))


def test_sampled_token_is_in_its_kept_set_and_logprob_is_normalized_over_it(device):
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(1)).to(device) * 2
    out = sample(
        logits, temperature=0.9, top_k=10, top_p=0.8, generator=torch.Generator(device).manual_seed(1)
    )
    assert out.tokens.device.type == out.kept_ids.device.type == out.kept_offsets.device.type == device.type
    for row in range(64):
        kept = out.kept_ids[out.kept_offsets[row] : out.kept_offsets[row + 1]].long()
        assert 1 <= len(kept) <= 10
        assert out.tokens[row] in kept
        expected = (logits[row, out.tokens[row]] / 0.9) - torch.logsumexp(logits[row, kept] / 0.9, 0)
        torch.testing.assert_close(out.logprobs[row], expected)


def test_no_filter_keeps_the_whole_vocabulary():
    logits = torch.randn(3, 12)
    out = sample(logits, generator=torch.Generator().manual_seed(0))
    assert out.kept_offsets.tolist() == [0, 12, 24, 36]
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1).gather(1, out.tokens[:, None]).squeeze(1))


def test_draws_follow_the_processed_distribution(device):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=device).repeat(20000, 1)
    generator = torch.Generator(device).manual_seed(2)
    out = sample(logits, top_k=3, generator=generator)
    again = sample(logits, top_k=3, generator=torch.Generator(device).manual_seed(2))
    assert torch.equal(out.tokens, again.tokens)  # seeded per device: reproducible
    freq = torch.bincount(out.tokens, minlength=4).float().cpu() / 20000
    expected = torch.tensor([2.0, 1.0, 0.0]).softmax(0)
    torch.testing.assert_close(freq[:3], expected, atol=0.015, rtol=0)
    assert freq[3] == 0


def test_bad_temperature():
    with pytest.raises(ValueError, match="temperature=0"):
        sample(torch.zeros(1, 4), temperature=0)
