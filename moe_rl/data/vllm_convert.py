"""vLLM ``RequestOutput`` / ``CompletionOutput`` -> ``TrajectoryBatch``, by attribute access only.

Written against vLLM 0.32's output types (``vllm/outputs.py``) without importing vLLM:

* ``RequestOutput.prompt_token_ids`` and ``.outputs`` (one ``CompletionOutput`` per sample, n >= 1);
* ``CompletionOutput.token_ids``, ``.finish_reason`` (``stop``/``length``/``abort``/``repetition``;
  ``error`` and unfinished outputs are rejected: a failed request is no trajectory);
* ``.logprobs``: per generated token a ``{token_id: Logprob(logprob=...)}`` dict (a list of them or
  vLLM's ``FlatLogprobs``); the engine must run with ``logprobs_mode="processed_logprobs"`` and
  ``SamplingParams(logprobs=0)`` or more, so the sampled token's processed log-prob is present;
* ``.routed_experts``: ``np.ndarray [seq_len, layers, k]`` over prompt + generated tokens; vLLM
  returns ``prompt_len + response_len - 1`` rows (it never runs the last sampled token) — both that
  and the full length are accepted;
* ``.sampling_mask``: ``SamplingMask(token_ids=list[list[int]])`` or CSR (``token_ids`` flat plus
  ``offsets``), one kept set per generated token;
* ``.weight_versions``: ``list[WeightVersionSpan(version: str, start, end)]`` over output tokens.
  Labels must be integers (the driver sets them with ``set_weight_version(str(version))``); when
  the engine reports none, every token is attributed to ``policy_version``.

The result is validated before it is returned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from moe_rl.data.errors import TrajectoryError
from moe_rl.data.sampling_mask import csr_from_lists
from moe_rl.data.trajectory import FINISH_REASONS, Sample, TrajectoryBatch
from moe_rl.data.validate import validate

logger = logging.getLogger(__name__)

_ENGINE_HINT = "SamplingParams(logprobs=0) with LLM(logprobs_mode='processed_logprobs')"


def from_vllm_outputs(
    request_outputs: Sequence[Any],
    *,
    policy_version: int,
    quant_recipe: str,
    engine: str = "vllm",
    num_experts: int | None = None,
    rewards: Sequence[float] | None = None,
    group_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> TrajectoryBatch:
    """Convert vLLM request outputs into a validated ``TrajectoryBatch``.

    Samples are ordered request by request, completion by completion. ``group_ids`` defaults to
    the request index (the n completions of one prompt form a group); ``rewards`` defaults to 0
    (rewards are usually attached later with ``batch.replace(rewards=...)``). ``num_experts`` is
    required when the outputs carry routed experts (vLLM does not report it).
    """
    samples: list[Sample] = []
    for request_index, request in enumerate(request_outputs):
        prompt_ids = _prompt_ids(request, len(samples))
        for completion in request.outputs:
            samples.append(
                completion_to_sample(
                    prompt_ids,
                    completion,
                    sample=len(samples),
                    group_id=request_index,
                    policy_version=policy_version,
                )
            )
    _override(samples, "reward", rewards)
    _override(samples, "group_id", group_ids)
    batch = TrajectoryBatch.from_samples(
        samples,
        engine=engine,
        quant_recipe=quant_recipe,
        policy_version=policy_version,
        num_experts=num_experts,
    )
    validate(batch, vocab_size=vocab_size)
    logger.debug(
        "converted %d vLLM completions (%d response tokens)", len(samples), batch.num_response_tokens
    )
    return batch


def completion_to_sample(
    prompt_ids: Sequence[int], completion: Any, *, sample: int, group_id: int, policy_version: int
) -> Sample:
    """One ``CompletionOutput`` (with its request's prompt ids) -> a ``Sample``."""
    token_ids = [int(t) for t in completion.token_ids]
    routing = getattr(completion, "routed_experts", None)
    if routing is not None:
        _check_routing_length(np.asarray(routing), len(prompt_ids), len(token_ids), sample)
    mask = _sampling_mask(getattr(completion, "sampling_mask", None), len(token_ids), sample)
    return Sample(
        prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.int32),
        response_ids=torch.tensor(token_ids, dtype=torch.int32),
        rollout_logp=torch.from_numpy(_sampled_logprobs(completion.logprobs, token_ids, sample)),
        reward=0.0,
        group_id=group_id,
        finish_reason=_finish_reason(completion.finish_reason, sample),
        version_spans=_version_spans(
            getattr(completion, "weight_versions", None), len(token_ids), sample, policy_version
        ),
        sampling_mask_ids=None if mask is None else mask[0],
        sampling_mask_offsets=None if mask is None else mask[1],
        routed_experts=None if routing is None else torch.from_numpy(np.array(routing, copy=True)),
    )


def _override(samples: list[Sample], name: str, values: Sequence[Any] | None) -> None:
    if values is None:
        return
    if len(values) != len(samples):
        raise TrajectoryError(
            name + "s", "one value per completion required", value=len(values), expected=str(len(samples))
        )
    for s, v in zip(samples, values, strict=True):
        setattr(s, name, v)


def _prompt_ids(request: Any, sample: int) -> list[int]:
    prompt_ids = getattr(request, "prompt_token_ids", None)
    if not prompt_ids:
        raise TrajectoryError(
            "prompt_token_ids",
            "request output has no prompt token ids",
            sample=sample,
            value=prompt_ids,
            expected="a non-empty list of token ids",
        )
    return [int(t) for t in prompt_ids]


def _finish_reason(reason: Any, sample: int) -> str:
    text = None if reason is None else str(reason)
    if text not in FINISH_REASONS:
        raise TrajectoryError(
            "finish_reason",
            "unfinished or failed completion",
            sample=sample,
            value=text,
            expected=f"one of {FINISH_REASONS}",
        )
    return text


def _sampled_logprobs(logprobs: Any, token_ids: list[int], sample: int) -> np.ndarray:
    """float32 processed log-prob of each sampled token."""
    if logprobs is None:
        raise TrajectoryError(
            "logprobs", "engine returned no log-probs", sample=sample, value=None, expected=_ENGINE_HINT
        )
    if len(logprobs) != len(token_ids):
        raise TrajectoryError(
            "logprobs",
            "one entry per generated token required",
            sample=sample,
            value=len(logprobs),
            expected=str(len(token_ids)),
        )
    if all(hasattr(logprobs, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs")):
        return _flat_sampled_logprobs(logprobs, token_ids, sample)
    out = np.empty(len(token_ids), dtype=np.float32)
    for t, (entry, token) in enumerate(zip(logprobs, token_ids, strict=True)):
        if not entry or token not in entry:
            _missing_logprob(sample, t, token)
        value = entry[token]
        out[t] = getattr(value, "logprob", value)
    return out


def _flat_sampled_logprobs(flat: Any, token_ids: list[int], sample: int) -> np.ndarray:
    """Vectorized lookup in vLLM's ``FlatLogprobs`` (parallel lists with per-position ranges)."""
    starts, ends = np.asarray(flat.start_indices, np.int64), np.asarray(flat.end_indices, np.int64)
    counts = ends - starts
    rows = np.repeat(np.arange(len(token_ids)), counts)
    positions = (
        np.repeat(starts, counts)
        + np.arange(int(counts.sum()))
        - np.repeat(np.cumsum(counts) - counts, counts)
    )
    hits = np.asarray(flat.token_ids, np.int64)[positions] == np.asarray(token_ids, np.int64)[rows]
    found_rows, first = np.unique(rows[hits], return_index=True)
    if found_rows.size != len(token_ids):
        t = int(np.setdiff1d(np.arange(len(token_ids)), found_rows)[0])
        _missing_logprob(sample, t, token_ids[t])
    return np.asarray(flat.logprobs, np.float64)[positions[hits][first]].astype(np.float32)


def _missing_logprob(sample: int, token: int, token_id: int) -> None:
    raise TrajectoryError(
        "logprobs",
        "no log-prob for the sampled token",
        sample=sample,
        token=token,
        value=token_id,
        expected=_ENGINE_HINT,
    )


def _version_spans(spans: Any, num_tokens: int, sample: int, default_version: int) -> list[tuple[int, int]]:
    """vLLM spans -> canonical ``[(start, version)]`` (contiguous, merged, starting at 0)."""
    if spans is None or (len(spans) == 0 and num_tokens == 0):
        return [(0, default_version)]
    fields = [_span_fields(span, sample) for span in spans]
    out: list[tuple[int, int]] = []
    cursor = 0
    for i, (start, version, end) in enumerate(fields):
        end = end if end is not None else (fields[i + 1][0] if i + 1 < len(fields) else num_tokens)
        if start != cursor or end < start:
            raise TrajectoryError(
                "weight_versions",
                "spans are not contiguous from token 0",
                sample=sample,
                value=(start, end),
                expected=f"a span starting at {cursor}",
            )
        if end > start and (not out or out[-1][1] != version):  # empty spans carry no token
            out.append((start, version))
        cursor = end
    if cursor != num_tokens or not out:
        raise TrajectoryError(
            "weight_versions",
            "spans do not cover every generated token",
            sample=sample,
            value=cursor,
            expected=f"spans ending at {num_tokens}",
        )
    return out


def _span_fields(span: Any, sample: int) -> tuple[int, int, int | None]:
    """``(start, version, end or None)`` of a ``WeightVersionSpan`` or a ``(start, version)`` pair."""
    if hasattr(span, "version"):
        start, label, end = span.start, span.version, getattr(span, "end", None)
    else:
        (start, label), end = span, None
    try:
        version = int(label)
    except (TypeError, ValueError):
        raise TrajectoryError(
            "weight_versions",
            "weight version label is not an integer",
            sample=sample,
            value=label,
            expected="integer labels (engine.set_weight_version(str(version)))",
        ) from None
    return int(start), version, None if end is None else int(end)


def _sampling_mask(mask: Any, num_tokens: int, sample: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if mask is None:
        return None
    if hasattr(mask, "offsets"):
        ids = torch.as_tensor(np.asarray(mask.token_ids, dtype=np.int64)).to(torch.int32)
        offsets = torch.as_tensor(np.asarray(mask.offsets, dtype=np.int64))
    else:
        ids, offsets = csr_from_lists(getattr(mask, "token_ids", mask))
    if offsets.numel() != num_tokens + 1:
        raise TrajectoryError(
            "sampling_mask",
            "one kept set per generated token required",
            sample=sample,
            value=offsets.numel() - 1,
            expected=str(num_tokens),
        )
    return ids, offsets


def _check_routing_length(routing: np.ndarray, prompt_len: int, response_len: int, sample: int) -> None:
    full = prompt_len + response_len
    if routing.ndim != 3 or routing.shape[0] not in (full, full - 1):
        raise TrajectoryError(
            "routed_experts",
            "routing must cover every prompt and generated token",
            sample=sample,
            value=tuple(routing.shape),
            expected=f"[{full} or {full - 1}, layers, k] (was routed_experts_prompt_start > 0?)",
        )
