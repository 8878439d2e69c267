"""Synthetic, valid trajectory batches and routing traces (for tests, benchmarks, dry runs).

``random_batch`` builds a batch that passes ``validate`` from a seed; ``skewed_routing`` draws
top-k expert choices with a per-layer popularity skew and token-to-token persistence, closer to
what trained MoE routers produce than uniform ids (uniform ids are incompressible and would make
any compressor look useless). Neither claims to reproduce a particular model's statistics.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from moe_rl.data import ragged
from moe_rl.data.routing import compact_routing
from moe_rl.data.trajectory import FINISH_REASONS, Sample, TrajectoryBatch


def skewed_routing(
    num_tokens: int,
    num_layers: int,
    topk: int,
    num_experts: int,
    *,
    seed: int = 0,
    zipf_exponent: float = 1.0,
    persistence: float = 0.3,
) -> np.ndarray:
    """int32 ``[num_tokens, num_layers, topk]`` top-k ids, distinct per (token, layer).

    Each layer ranks its experts by a Zipf-like popularity (``rank ** -zipf_exponent``, shuffled
    per layer); a token draws its top-k without replacement from that popularity (Gumbel top-k),
    and with probability ``persistence`` a token keeps the previous token's choice for a layer.
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    log_pop = np.stack([rng.permutation(-zipf_exponent * np.log(ranks)) for _ in range(num_layers)])
    out = np.empty((num_tokens, num_layers, topk), dtype=np.int32)
    chunk = max(1, (1 << 22) // max(1, num_layers * num_experts))
    for start in range(0, num_tokens, chunk):
        stop = min(num_tokens, start + chunk)
        scores = log_pop[None] + rng.gumbel(size=(stop - start, num_layers, num_experts))
        top = np.argpartition(-scores, topk - 1, axis=-1)[..., :topk]
        order = np.argsort(-np.take_along_axis(scores, top, axis=-1), axis=-1)
        out[start:stop] = np.take_along_axis(top, order, axis=-1)
    keep = rng.random((num_tokens, num_layers)) < persistence
    for t in range(1, num_tokens):
        out[t, keep[t]] = out[t - 1, keep[t]]
    return out


def random_batch(
    seed: int,
    num_samples: int,
    *,
    max_prompt_len: int = 8,
    max_response_len: int = 8,
    vocab_size: int = 64,
    routing: tuple[int, int, int] | None = None,
    sampling_mask: bool = False,
    old_logp: bool = False,
    group_size: int = 2,
    engine: str = "vllm",
    quant_recipe: str = "bf16",
    env_tokens: bool = False,
) -> TrajectoryBatch:
    """A valid random batch. ``routing`` is ``(num_moe_layers, topk, num_experts)`` or None.

    Routing traces randomly cover the last token or stop one short; responses may be empty;
    each sample has 1..3 weight-version spans. With ``env_tokens`` the batch is multi-turn: every
    response has a token, and a response of three or more has a stretch strictly inside it written
    by an environment (``sampled`` False, no log-prob, no kept set).
    """
    rng = np.random.default_rng(seed)
    samples = [
        _random_sample(
            rng, i, max_prompt_len, max_response_len, vocab_size, routing, sampling_mask, env_tokens
        )
        for i in range(num_samples)
    ]
    for i, s in enumerate(samples):
        s.group_id = i // group_size
        if old_logp:
            s.old_logp = -torch.from_numpy(rng.exponential(size=s.response_ids.numel()).astype(np.float32))
    policy_version = max((v for s in samples for _, v in s.version_spans), default=0) + int(
        rng.integers(0, 2)
    )
    num_experts = None if routing is None else routing[2]
    return TrajectoryBatch.from_samples(
        samples,
        engine=engine,
        quant_recipe=quant_recipe,
        policy_version=policy_version,
        num_experts=num_experts,
    )


def _random_sample(
    rng: np.random.Generator,
    index: int,
    max_prompt_len: int,
    max_response_len: int,
    vocab_size: int,
    routing: tuple[int, int, int] | None,
    sampling_mask: bool,
    env_tokens: bool = False,
) -> Sample:
    prompt_len = int(rng.integers(1, max_prompt_len + 1))
    response_len = int(rng.integers(int(env_tokens), max_response_len + 1))
    response = rng.integers(0, vocab_size, size=response_len)
    sample = Sample(
        prompt_ids=torch.from_numpy(rng.integers(0, vocab_size, size=prompt_len).astype(np.int32)),
        response_ids=torch.from_numpy(response.astype(np.int32)),
        rollout_logp=-torch.from_numpy(rng.exponential(size=response_len).astype(np.float32)),
        reward=float(rng.normal()),
        group_id=0,
        finish_reason=str(rng.choice(FINISH_REASONS)),
        version_spans=_random_spans(rng, response_len),
    )
    if sampling_mask:
        sample.sampling_mask_ids, sample.sampling_mask_offsets = _random_mask(rng, response, vocab_size)
    if routing is not None:
        layers, topk, experts = routing
        length = prompt_len + response_len - int(rng.integers(0, 2))
        trace = skewed_routing(length, layers, topk, experts, seed=int(rng.integers(1 << 31)))
        sample.routed_experts = compact_routing(trace, experts)
    if env_tokens:
        _environment_stretch(rng, sample)
    return sample


def _environment_stretch(rng: np.random.Generator, sample: Sample) -> None:
    """Mark a stretch strictly inside the response (length >= 3) as environment tokens."""
    length = sample.response_ids.numel()
    sample.sampled = torch.ones(length, dtype=torch.bool)
    if length < 3:
        return
    start = int(rng.integers(1, length - 1))
    stop = int(rng.integers(start + 1, length))
    sample.sampled[start:stop] = False
    sample.rollout_logp[start:stop] = float("nan")
    if sample.sampling_mask_ids is not None and sample.sampling_mask_offsets is not None:
        offsets = sample.sampling_mask_offsets
        rows = [sample.sampling_mask_ids[int(a) : int(b)] for a, b in itertools.pairwise(offsets)]
        rows[start:stop] = [sample.sampling_mask_ids[:0]] * (stop - start)
        sample.sampling_mask_ids = torch.cat(rows)
        sample.sampling_mask_offsets = ragged.offsets_from_lengths(torch.tensor([r.numel() for r in rows]))


def _random_spans(rng: np.random.Generator, response_len: int) -> list[tuple[int, int]]:
    num_spans = int(rng.integers(1, min(3, max(response_len, 1)) + 1))
    starts = [0, *sorted(rng.choice(np.arange(1, response_len), size=num_spans - 1, replace=False).tolist())]
    first = int(rng.integers(0, 5))
    versions = np.cumsum([first, *rng.integers(1, 3, size=num_spans - 1).tolist()])
    return [(int(s), int(v)) for s, v in zip(starts, versions, strict=True)]


def _random_mask(
    rng: np.random.Generator, response: np.ndarray, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for token in response.tolist():
        others = rng.choice(
            np.delete(np.arange(vocab_size), token),
            size=int(rng.integers(0, min(6, vocab_size - 1))),
            replace=False,
        )
        row = np.append(others, token)
        rng.shuffle(row)
        rows.append(row)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(flat), offsets
