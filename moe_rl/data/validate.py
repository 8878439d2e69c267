"""Validation of a ``TrajectoryBatch``: every malformed field is a ``TrajectoryError``.

``validate(batch)`` checks the whole contract (see ``moe_rl.data.trajectory``) and raises on the
first problem, naming the field, the sample (and token) index, the bad value and what is valid.
Nothing is dropped or repaired. ``check_staleness`` bounds how old the policy versions of a
batch may be relative to the trainer's version.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from moe_rl.data import ragged
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.routing import compact_dtype
from moe_rl.data.sampling_mask import csr_contains, csr_duplicate_rows
from moe_rl.data.trajectory import _ROUTING_FIELDS, FINISH_REASONS, TrajectoryBatch

DEFAULT_LOGP_TOLERANCE = 1e-4
"""Processed log-probs are <= 0; this much positive rounding error is tolerated."""

_FLAT_FIELDS = {
    "prompt_ids": torch.int32,
    "prompt_offsets": torch.int64,
    "response_ids": torch.int32,
    "response_offsets": torch.int64,
    "rollout_logp": torch.float32,
    "rewards": torch.float32,
    "group_ids": torch.int64,
    "version_span_starts": torch.int64,
    "version_span_versions": torch.int64,
    "version_span_offsets": torch.int64,
    "sampling_mask_ids": torch.int32,
    "sampling_mask_offsets": torch.int64,
    "routing_offsets": torch.int64,
    "old_logp": torch.float32,
    "sampled": torch.bool,
}
_OPTIONAL = ("sampling_mask_ids", "sampling_mask_offsets", "routing_offsets", "old_logp", "sampled")


def validate(
    batch: TrajectoryBatch,
    *,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    topk: int | None = None,
    logp_tolerance: float = DEFAULT_LOGP_TOLERANCE,
) -> None:
    """Raise ``TrajectoryError`` unless ``batch`` satisfies the trajectory contract.

    ``vocab_size``, when given, bounds token ids and kept ids to ``[0, vocab_size)``;
    ``num_experts`` and ``topk``, when given, are the model's: a routing trace must have been
    recorded with the same expert count and top-k (its ids are then bounded by ``num_experts``).
    """
    _check_types(batch)
    _check_metadata(batch)
    _check_samples(batch)
    _check_token_ids("prompt_ids", batch.prompt_ids, batch.prompt_offsets, vocab_size)
    _check_token_ids("response_ids", batch.response_ids, batch.response_offsets, vocab_size)
    _check_logp("rollout_logp", batch, batch.rollout_logp, logp_tolerance)
    if batch.old_logp is not None:
        _check_logp("old_logp", batch, batch.old_logp, logp_tolerance)
    _check_version_spans(batch)
    _check_sampling_mask(batch, vocab_size)
    _check_routing_model(batch, num_experts, topk)
    _check_routing(batch)


def check_staleness(batch: TrajectoryBatch, current_version: int, max_staleness: int) -> None:
    """Raise unless every sample satisfies ``current_version - oldest version <= max_staleness``.

    Versions newer than ``current_version`` are an error too (data from a policy the trainer has
    not produced yet means the versions are mislabelled).
    """
    oldest, newest = batch.sample_min_versions(), batch.sample_max_versions()
    stale = torch.nonzero(current_version - oldest > max_staleness).flatten().tolist()
    if stale:
        shown = {i: int(oldest[i]) for i in stale[:10]}
        raise TrajectoryError(
            "version_span_versions",
            f"{len(stale)} sample(s) older than allowed at trainer version {current_version}; "
            f"oldest version per stale sample (first 10): {shown}",
            sample=stale[0],
            value=int(oldest[stale[0]]),
            expected=f">= {current_version - max_staleness} (max_staleness={max_staleness})",
        )
    future = torch.nonzero(newest > current_version).flatten().tolist()
    if future:
        raise TrajectoryError(
            "version_span_versions",
            f"{len(future)} sample(s) newer than the trainer",
            sample=future[0],
            value=int(newest[future[0]]),
            expected=f"<= {current_version}",
        )


def _fail_at(
    field: str, offsets: Tensor, flat_index: int, problem: str, value: object, expected: str
) -> None:
    sample, token = ragged.locate(offsets, flat_index)
    raise TrajectoryError(field, problem, sample=sample, token=token, value=value, expected=expected)


def _first(mask: Tensor) -> int | None:
    """Index of the first True in a bool tensor, or None."""
    flat = mask.reshape(-1)
    return int(torch.argmax(flat.to(torch.uint8))) if bool(flat.any()) else None


def _check_types(batch: TrajectoryBatch) -> None:
    for name, dtype in _FLAT_FIELDS.items():
        value = getattr(batch, name)
        if value is None and name in _OPTIONAL:
            continue
        if not isinstance(value, Tensor):
            raise TrajectoryError(name, "must be a torch.Tensor", value=type(value).__name__)
        if value.device.type != "cpu":
            raise TrajectoryError(name, "trajectory tensors live on the CPU", value=str(value.device))
        if value.dtype != dtype or value.dim() != 1:
            raise TrajectoryError(
                name,
                "wrong dtype or shape",
                value=(str(value.dtype), tuple(value.shape)),
                expected=f"1-D {dtype}",
            )
    if not isinstance(batch.finish_reasons, list):
        raise TrajectoryError(
            "finish_reasons", "must be a list of str", value=type(batch.finish_reasons).__name__
        )


def _check_metadata(batch: TrajectoryBatch) -> None:
    for name in ("engine", "quant_recipe"):
        value = getattr(batch, name)
        if not isinstance(value, str) or not value:
            raise TrajectoryError(name, "must be a non-empty string", value=value)
    if (
        not isinstance(batch.policy_version, int)
        or isinstance(batch.policy_version, bool)
        or batch.policy_version < 0
    ):
        raise TrajectoryError("policy_version", "must be an int >= 0", value=batch.policy_version)


def _check_offsets(name: str, offsets: Tensor, num_rows: int, total: int, values_name: str) -> None:
    if offsets.numel() != num_rows + 1:
        raise TrajectoryError(
            name, "wrong length", value=offsets.numel(), expected=f"{num_rows + 1} (rows + 1)"
        )
    if int(offsets[0]) != 0:
        raise TrajectoryError(name, "must start at 0", value=int(offsets[0]), expected="0")
    bad = _first(offsets[1:] < offsets[:-1])
    if bad is not None:
        raise TrajectoryError(
            name,
            "offsets decrease (not monotone)",
            sample=bad,
            value=(int(offsets[bad]), int(offsets[bad + 1])),
            expected="non-decreasing offsets",
        )
    if int(offsets[-1]) != total:
        raise TrajectoryError(
            name,
            f"last offset does not match len({values_name})",
            value=int(offsets[-1]),
            expected=str(total),
        )


def _check_samples(batch: TrajectoryBatch) -> None:
    n = batch.prompt_offsets.numel() - 1
    _check_offsets("prompt_offsets", batch.prompt_offsets, n, batch.prompt_ids.numel(), "prompt_ids")
    _check_offsets("response_offsets", batch.response_offsets, n, batch.response_ids.numel(), "response_ids")
    empty = _first(batch.prompt_lengths() == 0)
    if empty is not None:
        raise TrajectoryError(
            "prompt_ids", "empty prompt", sample=empty, value=0, expected=">= 1 prompt token"
        )
    for name, value in (
        ("rollout_logp", batch.rollout_logp),
        ("old_logp", batch.old_logp),
        ("sampled", batch.sampled),
    ):
        if value is not None and value.numel() != batch.response_ids.numel():
            raise TrajectoryError(
                name,
                "length differs from response_ids",
                value=value.numel(),
                expected=str(batch.response_ids.numel()),
            )
    for name in ("rewards", "group_ids", "finish_reasons"):
        if len(getattr(batch, name)) != n:
            raise TrajectoryError(
                name, "one entry per sample required", value=len(getattr(batch, name)), expected=str(n)
            )
    bad = _first(~torch.isfinite(batch.rewards))
    if bad is not None:
        raise TrajectoryError("rewards", "reward must be finite", sample=bad, value=float(batch.rewards[bad]))
    if batch.sampled is not None:
        none = _first(batch.sampled_lengths() == 0)
        if none is not None:
            raise TrajectoryError(
                "sampled", "sample has no sampled token (nothing to train on)", sample=none,
                value=batch.sample(none).sampled.tolist()[:16], expected="at least one True per sample",
            )  # fmt: skip
    for i, reason in enumerate(batch.finish_reasons):
        if reason not in FINISH_REASONS:
            raise TrajectoryError(
                "finish_reasons",
                "unknown finish reason",
                sample=i,
                value=reason,
                expected=f"one of {FINISH_REASONS}",
            )


def _check_token_ids(name: str, ids: Tensor, offsets: Tensor, vocab_size: int | None) -> None:
    bad = _first(ids < 0) if vocab_size is None else _first((ids < 0) | (ids >= vocab_size))
    if bad is not None:
        expected = ">= 0" if vocab_size is None else f"0..{vocab_size - 1} (vocab_size={vocab_size})"
        _fail_at(name, offsets, bad, "token id out of range", int(ids[bad]), expected)


def _check_logp(name: str, batch: TrajectoryBatch, logp: Tensor, tolerance: float) -> None:
    """Sampled tokens: a finite log-prob <= 0; environment tokens (``sampled`` False): NaN (none)."""
    offsets, sampled = batch.response_offsets, batch.sampled_mask()
    bad = _first(sampled & torch.isnan(logp))
    if bad is not None:
        _fail_at(name, offsets, bad, "missing log-prob (NaN) on a sampled token", "nan",
                 "a finite log-prob <= 0 for every token the model sampled")  # fmt: skip
    bad = _first(sampled & (~torch.isfinite(logp) | (logp > tolerance)))
    if bad is not None:
        _fail_at(
            name,
            offsets,
            bad,
            "log-prob must be finite and <= 0 (processed log-probs)",
            float(logp[bad]),
            f"finite and <= {tolerance}",
        )
    bad = _first(~sampled & ~torch.isnan(logp))
    if bad is not None:
        _fail_at(name, offsets, bad, "log-prob on an environment token (sampled=False)", float(logp[bad]),
                 "NaN: the environment wrote this token, the model did not sample it")  # fmt: skip


def _check_version_spans(batch: TrajectoryBatch) -> None:
    starts, versions, offsets = (
        batch.version_span_starts,
        batch.version_span_versions,
        batch.version_span_offsets,
    )
    _check_offsets("version_span_offsets", offsets, batch.num_samples, starts.numel(), "version_span_starts")
    if versions.numel() != starts.numel():
        raise TrajectoryError(
            "version_span_versions",
            "length differs from version_span_starts",
            value=versions.numel(),
            expected=str(starts.numel()),
        )
    none = _first(ragged.lengths(offsets) == 0)
    if none is not None:
        raise TrajectoryError(
            "version_span_starts",
            "sample has no weight-version span",
            sample=none,
            value=[],
            expected="at least one span starting at token 0",
        )
    first = _first(starts[offsets[:-1]] != 0)
    if first is not None:
        raise TrajectoryError(
            "version_span_starts",
            "first span must start at response token 0",
            sample=first,
            value=int(starts[offsets[first]]),
            expected="0",
        )
    _check_span_order(batch)


def _check_span_order(batch: TrajectoryBatch) -> None:
    """Within each sample: strictly increasing starts and versions, starts inside the response,
    versions in ``[0, policy_version]``."""
    starts, versions = batch.version_span_starts, batch.version_span_versions
    rows = ragged.row_ids(batch.version_span_offsets)
    same = rows[1:] == rows[:-1]
    for name, values in (("version_span_starts", starts), ("version_span_versions", versions)):
        bad = _first(same & (values[1:] <= values[:-1]))
        if bad is not None:
            raise TrajectoryError(
                name,
                "spans must strictly increase within a sample",
                sample=int(rows[bad]),
                value=batch.sample(int(rows[bad])).version_spans,
                expected="strictly increasing starts and versions (merge equal neighbours)",
            )
    limit = torch.clamp(batch.response_lengths(), min=1)[rows]
    bad = _first(starts >= limit)
    if bad is not None:
        raise TrajectoryError(
            "version_span_starts",
            "span starts past the last response token",
            sample=int(rows[bad]),
            value=int(starts[bad]),
            expected=f"< {int(limit[bad])}",
        )
    bad = _first((versions < 0) | (versions > batch.policy_version))
    if bad is not None:
        raise TrajectoryError(
            "version_span_versions",
            "version outside [0, policy_version]",
            sample=int(rows[bad]),
            value=int(versions[bad]),
            expected=f"0..{batch.policy_version}",
        )


def _check_sampling_mask(batch: TrajectoryBatch, vocab_size: int | None) -> None:
    ids, offsets = batch.sampling_mask_ids, batch.sampling_mask_offsets
    if ids is None and offsets is None:
        return
    if ids is None or offsets is None:
        raise TrajectoryError(
            "sampling_mask_offsets" if offsets is None else "sampling_mask_ids",
            "sampling_mask_ids and sampling_mask_offsets come together",
            value=None,
        )
    num_tokens = batch.response_ids.numel()
    _check_offsets("sampling_mask_offsets", offsets, num_tokens, ids.numel(), "sampling_mask_ids")
    resp, sampled = batch.response_offsets, batch.sampled_mask()
    row_len = ragged.lengths(offsets)
    empty = _first(sampled & (row_len == 0))
    if empty is not None:
        _fail_at("sampling_mask_offsets", resp, empty, "empty kept set", [], "at least the sampled token")
    kept = _first(~sampled & (row_len > 0))
    if kept is not None:
        row = ids[int(offsets[kept]) : int(offsets[kept + 1])].tolist()
        _fail_at("sampling_mask_ids", resp, kept, "kept set on an environment token (sampled=False)", row,
                 "an empty row: the model did not sample this token")  # fmt: skip
    bad = _first(ids < 0) if vocab_size is None else _first((ids < 0) | (ids >= vocab_size))
    if bad is not None:
        row, _ = ragged.locate(offsets, bad)
        expected = ">= 0" if vocab_size is None else f"0..{vocab_size - 1} (vocab_size={vocab_size})"
        _fail_at("sampling_mask_ids", resp, row, "kept id out of range", int(ids[bad]), expected)
    dup = _first(csr_duplicate_rows(ids, offsets))
    if dup is not None:
        row = ids[int(offsets[dup]) : int(offsets[dup + 1])].tolist()
        _fail_at("sampling_mask_ids", resp, dup, "duplicate id in kept set", row, "distinct ids")
    missing = _first(sampled & ~csr_contains(ids, offsets, batch.response_ids))
    if missing is not None:
        _fail_at(
            "sampling_mask_ids",
            resp,
            missing,
            "sampled token not in its kept set",
            int(batch.response_ids[missing]),
            "the sampled token among the kept ids",
        )


def _check_routing(batch: TrajectoryBatch) -> None:
    present = {name: getattr(batch, name) is not None for name in _ROUTING_FIELDS}
    if not any(present.values()):
        return
    if not all(present.values()):
        missing = [name for name, ok in present.items() if not ok]
        raise TrajectoryError(
            missing[0], "routing fields come together", value=None, expected=str(_ROUTING_FIELDS)
        )
    _check_routing_shape(batch)
    trace, offsets = batch.routed_experts, batch.routing_offsets
    assert trace is not None and offsets is not None and batch.num_experts is not None
    _check_offsets("routing_offsets", offsets, batch.num_samples, trace.shape[0], "routed_experts")
    seq, got = batch.sequence_lengths(), batch.routing_lengths()
    bad = _first((got != seq) & (got != seq - 1))
    if bad is not None:
        raise TrajectoryError(
            "routing_offsets",
            "wrong routing trace length",
            sample=bad,
            value=int(got[bad]),
            expected=f"prompt_len + response_len = {int(seq[bad])} or one less",
        )
    # numpy: comparisons and small sorts on uint8/uint16 directly (torch lacks most uint16 ops).
    topk_idx = trace.numpy()
    if topk_idx.size and int(topk_idx.max()) >= batch.num_experts:
        _fail_routing_at(
            offsets,
            (topk_idx >= batch.num_experts).any(axis=-1),
            topk_idx,
            "expert id >= num_experts",
            f"ids in 0..{batch.num_experts - 1}",
        )
    _fail_routing_at(
        offsets,
        _duplicate_in_topk(topk_idx),
        topk_idx,
        "duplicate expert id within a token's top-k",
        "distinct expert ids per token and layer",
    )


def _check_routing_model(batch: TrajectoryBatch, num_experts: int | None, topk: int | None) -> None:
    """A routing trace must come from a model with ``num_experts`` experts and top-``topk`` routing."""
    if batch.routed_experts is None:
        return
    for name, model_value, key in (
        ("num_experts", num_experts, "num_experts"),
        ("topk", topk, "moe_router_topk"),
    ):
        value = getattr(batch, name)
        if model_value is not None and value != model_value:
            raise TrajectoryError(
                name,
                "routing trace recorded with a different MoE shape than the model's",
                value=value,
                expected=f"{model_value} (model.{key})",
            )


def _duplicate_in_topk(topk_idx: np.ndarray) -> np.ndarray:
    """bool ``[tokens, layers]``: some id appears twice in the top-k (pairwise compares beat sorting)."""
    dup = np.zeros(topk_idx.shape[:2], dtype=bool)
    for i in range(topk_idx.shape[2]):
        for j in range(i + 1, topk_idx.shape[2]):
            dup |= topk_idx[..., i] == topk_idx[..., j]
    return dup


def _fail_routing_at(
    offsets: Tensor, bad_TL: np.ndarray, topk_idx: np.ndarray, problem: str, expected: str
) -> None:
    """Raise for the first (token, layer) flagged in ``bad_TL``, naming sample, position and layer."""
    hits = np.flatnonzero(bad_TL)
    if hits.size:
        row, layer = divmod(int(hits[0]), bad_TL.shape[1])
        _fail_at(
            "routed_experts",
            offsets,
            row,
            f"{problem} (MoE layer {layer})",
            topk_idx[row, layer].tolist(),
            expected,
        )


def _check_routing_shape(batch: TrajectoryBatch) -> None:
    trace = batch.routed_experts
    assert trace is not None and batch.num_experts is not None
    for name in ("num_moe_layers", "num_experts", "topk"):
        value = getattr(batch, name)
        if not isinstance(value, int) or value < 1:
            raise TrajectoryError(name, "must be an int >= 1", value=value)
    assert batch.topk is not None
    if batch.topk > batch.num_experts:
        raise TrajectoryError(
            "topk",
            "top-k exceeds the number of experts",
            value=batch.topk,
            expected=f"<= num_experts = {batch.num_experts}",
        )
    dtype = compact_dtype(batch.num_experts)
    if not isinstance(trace, Tensor) or trace.dtype != dtype or trace.dim() != 3:
        raise TrajectoryError(
            "routed_experts",
            "wrong dtype or rank",
            value=(str(getattr(trace, "dtype", None)), tuple(getattr(trace, "shape", ()))),
            expected=f"3-D {dtype} [tokens, layers, k]",
        )
    if tuple(trace.shape[1:]) != (batch.num_moe_layers, batch.topk):
        raise TrajectoryError(
            "routed_experts",
            "layer count / top-k mismatch",
            value=tuple(trace.shape[1:]),
            expected=f"(num_moe_layers, topk) = ({batch.num_moe_layers}, {batch.topk})",
        )
