"""Token sampler with vLLM's semantics, for the Megatron engine.

Order, as in vLLM's V1 sampler (`vllm/v1/sample/ops/topk_topp_sampler.py`): logits / temperature,
then top-k (ties at the k-th value kept), then top-p over the top-k renormalized probabilities
(the smallest set of highest-probability tokens whose mass reaches p; at least one token kept),
then a categorical draw. `processed_logprobs` are log-softmax over the processed logits, i.e.
normalized over the kept set, and the kept set of every draw is returned in CSR form (flat ids +
offsets), the layout of vLLM's `sampling_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleOutput:
    """One decoding step for a batch of rows."""

    tokens: torch.Tensor
    """[B] sampled ids."""
    logprobs: torch.Tensor
    """[B] processed log-prob of each sampled id (normalized over its kept set)."""
    kept_ids: torch.Tensor | None
    """Flat kept ids of every row (CSR values), or None when nothing is filtered."""
    kept_offsets: torch.Tensor | None
    """[B + 1] CSR offsets into `kept_ids`."""


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p; filtered entries are −inf. `logits` is [B, V]."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use a small value for near-greedy)")
    out = logits.float() / temperature
    vocab = out.shape[-1]
    if top_k == -1 and top_p >= 1.0:
        return out
    if top_k != -1 and not top_k > 0:
        raise ValueError(f"top_k={top_k} must be -1 (off) or > 0")
    sorted_logits, idx = out.sort(dim=-1, descending=False)
    if top_k != -1 and top_k < vocab:
        threshold = sorted_logits[:, vocab - top_k].unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p < 1.0:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(out).scatter_(-1, idx, sorted_logits)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    return_kept: bool = True,
) -> SampleOutput:
    """Draw one token per row of `logits` [B, V] with vLLM's processing (see module docstring).

    Everything is computed on the logits' device; ``generator`` must be a generator of that
    device (a CUDA draw cannot use a CPU generator).
    """
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(
            f"sampler generator is on {generator.device}, the logits on {logits.device}: create the "
            "generator on the logits' device (torch.Generator(device=...))"
        )
    processed = process_logits(logits, temperature, top_k, top_p)
    logp = processed.log_softmax(dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    kept_ids = kept_offsets = None
    if return_kept:
        kept = torch.isfinite(processed)
        rows, cols = kept.nonzero(as_tuple=True)
        counts = kept.sum(dim=1)
        kept_offsets = torch.zeros(len(counts) + 1, dtype=torch.int64, device=logits.device)
        kept_offsets[1:] = counts.cumsum(0)
        kept_ids = cols.to(torch.int32)
        del rows
    return SampleOutput(tokens, logp.gather(1, tokens[:, None]).squeeze(1), kept_ids, kept_offsets)
