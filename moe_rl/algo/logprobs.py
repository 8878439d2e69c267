"""Per-token log-probabilities and entropies from logits, without a whole fp32 [tokens, vocab] copy.

* `token_logprobs`: ``logp_t = z_t[y_t]/T − logsumexp(z_t/T)`` over the full vocabulary.
* `masked_token_logprobs`: keep-sampling-mask (KSM, DeepSeek-V3.2 §3.1, arXiv 2512.02556):
  ``logp_t^S = z_t[y_t]/T − logsumexp_{v∈S_t}(z_t[v]/T)`` over the ids the engine kept after
  top-k / top-p (vLLM ``return_sampling_mask``; CSR ``kept_ids`` + ``kept_offsets``). This is
  what vLLM's ``processed_logprobs`` report, so engine and trainer compare like with like.
* `token_entropy`: ``e_t = −Σ_v p_v log p_v`` over the full vocabulary (ESPO needs it for π_old).

`token_logprobs` and `token_entropy` run the vocabulary reduction in chunks of `chunk_size`
tokens, forward and backward (custom autograd functions that recompute the softmax per chunk),
so the only [tokens, vocab] tensors are the logits and, under autograd, their gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 512


def _check_logits(logits: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary last dim, got shape {tuple(logits.shape)}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_tokens_in_vocab(tokens: Tensor, num_tokens: int, vocab: int, check_range: bool = True) -> None:
    if tokens.dtype != torch.long or tokens.numel() != num_tokens:
        raise ValueError(
            f"tokens must be torch.long with {num_tokens} elements (one per logits row), "
            f"got dtype {tokens.dtype}, {tokens.numel()} elements"
        )
    if check_range:
        _check_ids_in_vocab("tokens", tokens, vocab)


def _check_ids_in_vocab(name: str, ids: Tensor, vocab: int) -> None:
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= vocab:
        pos = int(((ids < 0) | (ids >= vocab)).nonzero()[0, 0])
        raise ValueError(f"{name}[{pos}] = {int(ids[pos])} is outside the vocabulary [0, {vocab})")


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 logits, float64 for float64 logits."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    chunk = chunk.to(_compute_dtype(chunk))
    return chunk if temperature == 1.0 else chunk / temperature


class _ChunkedTokenLogprob(torch.autograd.Function):
    """Chunked ``log_softmax(z/T)[y]``; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num = logits.shape[0]
        out = torch.empty(num, dtype=_compute_dtype(logits), device=logits.device)
        for start in range(0, num, chunk_size):
            x = _scaled(logits[start : start + chunk_size], temperature)
            lp = torch.log_softmax(x, dim=-1)
            out[start : start + chunk_size] = lp.gather(1, tokens[start : start + chunk_size, None]).squeeze(
                1
            )
            del x, lp
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            p = torch.softmax(_scaled(logits[sl], temperature), dim=-1)
            g_out = grad_out[sl, None].to(p.dtype)
            # d logp / d z_v = (1[v = y] − p_v) / T
            g = p.mul_(-g_out).scatter_add_(1, tokens[sl, None], g_out)
            grad[sl] = g.div_(temperature) if temperature != 1.0 else g
            del p, g
        return grad, None, None, None


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probability of each sampled token under ``softmax(logits / T)`` (float32; float64 for float64 logits).

    ``logp_t = z_t[y_t]/T − logsumexp_v(z_t[v]/T)``, computed `chunk_size` rows at a time in
    float32, forward and backward, so no full fp32 [tokens, vocab] tensor is materialized.
    Gradients flow to `logits` (returned in the logits' dtype).

    Args:
        logits: [..., V] logits of any float dtype.
        tokens: [...] long sampled ids in ``[0, V)``.
        temperature: the rollout temperature T (> 0).
        chunk_size: rows per chunk.

    Every token id is checked to be in ``[0, V)`` (one host sync).
    """
    _check_logits(logits, temperature, chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    _check_tokens_in_vocab(tokens, flat.shape[0], flat.shape[1])
    out = _ChunkedTokenLogprob.apply(flat, tokens.reshape(-1), float(temperature), chunk_size)
    return out.reshape(logits.shape[:-1])


class _ChunkedEntropy(torch.autograd.Function):
    """Chunked entropy of ``softmax(z/T)``; backward ``dH/dx_j = −p_j (log p_j + H)``."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num = logits.shape[0]
        out = torch.empty(num, dtype=_compute_dtype(logits), device=logits.device)
        for start in range(0, num, chunk_size):
            x = _scaled(logits[start : start + chunk_size], temperature)
            logp = torch.log_softmax(x, dim=-1)
            p = logp.exp()
            # −Σ p·log p; clamping log p keeps 0·(−inf) = nan out for masked (−inf) logits
            out[start : start + chunk_size] = -p.mul_(logp.clamp_min_(torch.finfo(logp.dtype).min)).sum(-1)
            del x, logp, p
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logp = torch.log_softmax(_scaled(logits[sl], temperature), dim=-1)
            p = logp.exp()
            inner = logp.clamp_min_(torch.finfo(logp.dtype).min).add_(entropy[sl, None])
            g = p.mul_(inner).mul_(-grad_out[sl, None].to(p.dtype))
            grad[sl] = g.div_(temperature) if temperature != 1.0 else g
        return grad, None, None


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Full-vocabulary entropy ``e_t = −Σ_v p_v log p_v`` of ``softmax(logits / T)``, float32.

    Chunked over rows like `token_logprobs`; differentiable w.r.t. `logits`. Logits of −inf
    (masked ids) contribute 0. Used by ESPO (arXiv 2512.00499) on π_old and by RL-ZVP.
    """
    _check_logits(logits, temperature, chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    out = _ChunkedEntropy.apply(flat, float(temperature), chunk_size)
    return out.reshape(logits.shape[:-1])


def _check_kept(tokens: Tensor, kept_ids: Tensor, kept_offsets: Tensor, vocab: int) -> None:
    """Validate the CSR keep-sampling mask; one host sync per check (skip with validate=False)."""
    num = tokens.numel()
    if kept_ids.dim() != 1 or kept_ids.dtype != torch.long:
        raise ValueError(
            f"kept_ids must be a 1-D torch.long tensor, got {kept_ids.dtype} {tuple(kept_ids.shape)}"
        )
    if kept_offsets.dim() != 1 or kept_offsets.dtype != torch.long or kept_offsets.numel() != num + 1:
        raise ValueError(
            f"kept_offsets must be a 1-D torch.long tensor of length tokens+1 = {num + 1}, "
            f"got {kept_offsets.dtype} {tuple(kept_offsets.shape)}"
        )
    first, last = int(kept_offsets[0]), int(kept_offsets[-1])
    if first != 0 or last != kept_ids.numel():
        raise ValueError(
            f"kept_offsets must start at 0 and end at len(kept_ids) = {kept_ids.numel()}, got {first} .. {last}"
        )
    step = kept_offsets[1:] - kept_offsets[:-1]
    if bool((step < 0).any()):
        pos = int((step < 0).nonzero()[0, 0])
        raise ValueError(
            f"kept_offsets must be non-decreasing; token position {pos} has offsets "
            f"{int(kept_offsets[pos])} > {int(kept_offsets[pos + 1])}"
        )
    _check_ids_in_vocab("kept_ids", kept_ids, vocab)


class _KeptLogprob(torch.autograd.Function):
    """``z[y]/T − logsumexp_{v∈S}(z[v]/T)`` on the gathered kept logits; backward writes only
    the kept positions of a zero gradient: ``(1[v = y] − p^S_v)·g/T`` (one [N, V] allocation,
    the gradient itself)."""

    @staticmethod
    def forward(ctx, logits, tokens, kept_ids, rows, temperature: float):
        num, vocab = logits.shape
        dtype = _compute_dtype(logits)
        flat_idx = torch.mul(rows, vocab).add_(kept_ids)  # row·V + id into the flat logits
        kept = logits.reshape(-1).index_select(0, flat_idx).to(dtype)
        sampled = logits.gather(1, tokens[:, None]).squeeze(1).to(dtype)
        if temperature != 1.0:
            kept, sampled = kept.div_(temperature), sampled / temperature
        peak = torch.full((num,), -torch.inf, dtype=dtype, device=logits.device)
        peak.scatter_reduce_(0, rows, kept, reduce="amax", include_self=True)
        probs = kept.sub_(peak.index_select(0, rows)).exp_()
        sumexp = torch.zeros_like(peak).index_add_(0, rows, probs)
        probs.div_(sumexp.index_select(0, rows))
        ctx.save_for_backward(flat_idx, rows, probs, tokens)
        ctx.shape, ctx.dtype, ctx.temperature = (num, vocab), logits.dtype, temperature
        return sampled - sumexp.log_().add_(peak)

    @staticmethod
    def backward(ctx, grad_out):
        flat_idx, rows, probs, tokens = ctx.saved_tensors
        num, vocab = ctx.shape
        g = grad_out.to(probs.dtype) / ctx.temperature
        grad = torch.zeros(num * vocab, dtype=ctx.dtype, device=grad_out.device)
        grad.index_add_(0, flat_idx, (probs * -g[rows]).to(ctx.dtype))
        sampled_idx = torch.arange(num, device=grad.device) * vocab + tokens
        grad.index_add_(0, sampled_idx, g.to(ctx.dtype))
        return grad.view(num, vocab), None, None, None, None


def masked_token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    kept_ids: Tensor,
    kept_offsets: Tensor,
    temperature: float = 1.0,
    validate: bool = True,
) -> Tensor:
    """Keep-sampling-mask log-probs: ``z_t[y_t]/T − logsumexp_{v∈S_t}(z_t[v]/T)``, float32.

    DeepSeek-V3.2 §3.1 (arXiv 2512.02556). ``S_t`` is given in CSR form: the kept ids of token
    t are ``kept_ids[kept_offsets[t]:kept_offsets[t+1]]`` (unique within a set — not checked).
    Only the Σ|S_t| kept logits are gathered (float32), and the per-token logsumexp is a segment
    reduction (``scatter_reduce`` max + ``index_add``), so the forward's extra memory is
    O(Σ|S_t|), never O(tokens × vocab). Differentiable w.r.t. `logits`: the backward allocates
    only the [N, V] gradient and writes its Σ|S_t| kept entries (+ the sampled ids).

    Args:
        logits: [N, V] logits of any float dtype.
        tokens: [N] long sampled ids.
        kept_ids: [Σ|S_t|] long kept vocabulary ids, token-major.
        kept_offsets: [N+1] long CSR offsets.
        temperature: rollout temperature T (> 0).
        validate: check offsets, id ranges and ``y_t ∈ S_t`` (a few host syncs). With
            validate=False corrupt input gives undefined values instead of an error.

    Raises:
        ValueError: malformed offsets, ids outside the vocabulary, or a sampled token that is
            not in its kept set (the message names the token position and id).
    """
    _check_logits(logits, temperature, 1)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits.shape)}")
    num, vocab = logits.shape
    _check_tokens_in_vocab(tokens, num, vocab, check_range=validate)
    if validate:
        _check_kept(tokens, kept_ids, kept_offsets, vocab)
    counts = kept_offsets[1:] - kept_offsets[:-1]
    rows = torch.repeat_interleave(
        torch.arange(num, device=logits.device), counts, output_size=kept_ids.numel()
    )
    if validate:
        _check_membership(tokens, kept_ids, rows, num)
    return _KeptLogprob.apply(logits, tokens, kept_ids, rows, float(temperature))


def _check_membership(tokens: Tensor, kept_ids: Tensor, rows: Tensor, num: int) -> None:
    hit = kept_ids == tokens.index_select(0, rows)
    missing = torch.ones(num, dtype=torch.bool, device=tokens.device)
    missing[rows[hit]] = False
    if bool(missing.any()):
        pos = int(missing.nonzero()[0, 0])
        raise ValueError(
            f"sampled token id {int(tokens[pos])} at token position {pos} is not in its kept set "
            f"(keep-sampling mask); the trajectory is corrupt"
        )
