"""``TrajectoryBatch``: the contract between rollout engines and trainers.

Every response carries what the trainer needs to undo the off-policyness it knows about (see
docs/design.md, "The trajectory"). Ragged fields are stored flat with int64 offsets (``moe_rl.data.
ragged``); a batch of N samples has ``*_offsets`` of length N + 1.

Layout decisions
----------------
* Token ids are int32 (every vocabulary fits); offsets int64; log-probs and rewards float32.
* ``rollout_logp[t]`` is the engine's *processed* log-prob (after temperature / top-k / top-p)
  of response token ``t``; it is <= 0 up to rounding.
* Sampling mask (optional): CSR over response tokens, ``sampling_mask_offsets`` has
  ``num_response_tokens + 1`` entries; the sampled token must be in its row.
* Routing trace (optional): ``routed_experts`` ``[num_trace_tokens, num_moe_layers, topk]``,
  uint8 when ``num_experts <= 256`` else uint16, ragged per sample through ``routing_offsets``.
  A sample's trace covers its prompt AND response tokens in sequence order, starting at the first
  prompt token. Its length is either ``prompt_len + response_len`` (the engine also ran the last
  sampled token) or ``prompt_len + response_len - 1`` (vLLM: the last sampled token is never
  forwarded). Both are valid (``routing_lengths()`` against ``sequence_lengths()`` tells which).
  The last position's logits predict nothing the loss uses, so the packer fills a missing last row
  with a copy of the previous one and marks it in ``MicroBatch.routing_valid``.
* Weight-version spans: per sample, a list of ``(start_token, version)`` over response tokens,
  stored CSR (``version_span_starts``, ``version_span_versions``, ``version_span_offsets``).
  Canonical form: the first span starts at 0, starts and versions strictly increase (adjacent
  spans with one version are merged). A span runs up to the next span's start.
* Batch metadata: ``engine``, ``quant_recipe`` (e.g. ``bf16``, ``fp8``) and ``policy_version``
  (the engine's weight version when the batch was finished; every span version is <= it).
* ``old_logp`` (optional) is filled by the trainer's recompute pass; shards skip it by default.

Multi-turn trajectories (``moe_rl.envs``)
-----------------------------------------
The response of a multi-turn trajectory is everything after the first prompt: the model's turns
and what the environment wrote between them (tool output), in context order. ``sampled`` (optional,
bool ``[num_response_tokens]``) says who wrote each response token: True where the model sampled
it, False where the environment wrote it; absent, every response token was sampled. An
environment token has no rollout log-prob (``rollout_logp`` is NaN there) and no kept set (its
sampling-mask row is empty); its weight version is the one of the model turn before it. The routing
trace covers environment tokens like any other: the engine prefilled them, so they were routed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.data import ragged
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.routing import compact_routing

FINISH_REASONS = ("stop", "length", "abort", "repetition")
"""Finish reasons a trajectory may carry (vLLM's, less ``error``: a failed request is no sample)."""

SCHEMA_VERSION = 1

_ROUTING_FIELDS = ("routed_experts", "routing_offsets", "num_moe_layers", "num_experts", "topk")


@dataclass(eq=False)
class Sample:
    """One response as plain per-sample tensors (what ``TrajectoryBatch.sample(i)`` returns)."""

    prompt_ids: Tensor
    """int32 ``[prompt_len]``."""
    response_ids: Tensor
    """int32 ``[response_len]``."""
    rollout_logp: Tensor
    """float32 ``[response_len]``: the engine's processed log-prob of each sampled token."""
    reward: float
    group_id: int
    finish_reason: str
    version_spans: list[tuple[int, int]]
    """``(start_token, version)`` over response tokens; first start is 0."""
    sampling_mask_ids: Tensor | None = None
    """int32 ``[nnz]``: kept ids, CSR over response tokens."""
    sampling_mask_offsets: Tensor | None = None
    """int64 ``[response_len + 1]``, starting at 0."""
    routed_experts: Tensor | None = None
    """``[prompt_len + response_len (- 1), layers, k]`` expert ids (any integer dtype)."""
    old_logp: Tensor | None = None
    """float32 ``[response_len]``, trainer-side."""
    sampled: Tensor | None = None
    """bool ``[response_len]``: True where the model sampled the token, False where an environment
    wrote it (multi-turn); None: every response token was sampled."""


@dataclass(eq=False)
class TrajectoryBatch:
    """A batch of trajectories, ragged fields flat + offsets (see the module docstring).

    ``==`` is identity; compare contents with ``first_difference``.
    """

    prompt_ids: Tensor
    """int32 ``[num_prompt_tokens]``."""
    prompt_offsets: Tensor
    """int64 ``[num_samples + 1]``."""
    response_ids: Tensor
    """int32 ``[num_response_tokens]``."""
    response_offsets: Tensor
    """int64 ``[num_samples + 1]``."""
    rollout_logp: Tensor
    """float32 ``[num_response_tokens]``."""
    rewards: Tensor
    """float32 ``[num_samples]``."""
    group_ids: Tensor
    """int64 ``[num_samples]``: samples of one prompt share a group id."""
    finish_reasons: list[str]
    """One of ``FINISH_REASONS`` per sample."""
    version_span_starts: Tensor
    """int64 ``[num_spans]``: first response token of each span, within its sample."""
    version_span_versions: Tensor
    """int64 ``[num_spans]``: policy version that produced the span."""
    version_span_offsets: Tensor
    """int64 ``[num_samples + 1]``."""
    engine: str
    """Rollout engine name, e.g. ``vllm`` or ``megatron``."""
    quant_recipe: str
    """Rollout quantization recipe name, e.g. ``bf16``, ``fp8``."""
    policy_version: int
    """The engine's weight version when the batch was finished."""
    sampling_mask_ids: Tensor | None = None
    """int32 ``[nnz]`` or None."""
    sampling_mask_offsets: Tensor | None = None
    """int64 ``[num_response_tokens + 1]`` or None."""
    routed_experts: Tensor | None = None
    """uint8/uint16 ``[num_trace_tokens, num_moe_layers, topk]`` or None."""
    routing_offsets: Tensor | None = None
    """int64 ``[num_samples + 1]`` over trace tokens, or None."""
    num_moe_layers: int | None = None
    num_experts: int | None = None
    topk: int | None = None
    old_logp: Tensor | None = field(default=None)
    """float32 ``[num_response_tokens]`` or None; not written to disk unless asked."""
    sampled: Tensor | None = None
    """bool ``[num_response_tokens]``: who wrote each response token (True: the model sampled it;
    False: an environment wrote it); None: every response token was sampled."""

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Number of samples (responses) in the batch."""
        return self.prompt_offsets.numel() - 1

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_response_tokens(self) -> int:
        return self.response_ids.numel()

    @property
    def has_sampling_mask(self) -> bool:
        return self.sampling_mask_ids is not None

    @property
    def has_routing(self) -> bool:
        return self.routed_experts is not None

    def sampled_mask(self) -> Tensor:
        """bool ``[num_response_tokens]``: True where the model sampled the token (all True for
        single-turn batches, which carry no ``sampled`` field)."""
        if self.sampled is None:
            return torch.ones(self.num_response_tokens, dtype=torch.bool)
        return self.sampled

    def sampled_lengths(self) -> Tensor:
        """Sampled response tokens per sample, int64 ``[num_samples]``."""
        if self.sampled is None:
            return self.response_lengths()
        return ragged.row_sums(self.sampled.to(torch.int64), self.response_offsets)

    def prompt_lengths(self) -> Tensor:
        """int64 ``[num_samples]``."""
        return ragged.lengths(self.prompt_offsets)

    def response_lengths(self) -> Tensor:
        """int64 ``[num_samples]``."""
        return ragged.lengths(self.response_offsets)

    def sequence_lengths(self) -> Tensor:
        """Prompt + response length per sample, int64 ``[num_samples]``."""
        return self.prompt_lengths() + self.response_lengths()

    def routing_lengths(self) -> Tensor:
        """Trace length per sample, int64 ``[num_samples]`` (requires routing)."""
        if self.routing_offsets is None:
            raise TrajectoryError("routed_experts", "this batch carries no routing trace")
        return ragged.lengths(self.routing_offsets)

    # ---- versions ----------------------------------------------------------------------------
    def token_versions(self) -> Tensor:
        """Policy version of every response token, int64 ``[num_response_tokens]``."""
        resp_rows = ragged.row_ids(self.response_offsets)
        within = torch.arange(self.num_response_tokens) - self.response_offsets[resp_rows]
        span_rows = ragged.row_ids(self.version_span_offsets)
        # Global sort key: (sample, start). A token's span is the last span with key <= its key.
        if self.num_response_tokens == 0:
            return torch.zeros(0, dtype=torch.int64)
        scale = max(int(self.response_lengths().max()), int(self.version_span_starts.max())) + 1
        span_keys = span_rows * scale + self.version_span_starts
        token_keys = resp_rows * scale + within
        idx = torch.searchsorted(span_keys, token_keys, right=True) - 1
        return self.version_span_versions[idx]

    def sample_min_versions(self) -> Tensor:
        """Oldest policy version contributing to each sample, int64 ``[num_samples]``."""
        return self.version_span_versions[self.version_span_offsets[:-1]]

    def sample_max_versions(self) -> Tensor:
        """Newest policy version contributing to each sample, int64 ``[num_samples]``."""
        return self.version_span_versions[self.version_span_offsets[1:] - 1]

    def min_policy_version(self) -> int:
        """Oldest version of any token in the batch."""
        return int(self.version_span_versions.min())

    def max_policy_version(self) -> int:
        """Newest version of any token in the batch."""
        return int(self.version_span_versions.max())

    # ---- per-sample views ----------------------------------------------------------------------
    def sample(self, i: int) -> Sample:
        """Sample ``i`` as plain tensors (slices share memory with the batch)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} out of range for a batch of {self.num_samples}")
        p0, p1 = int(self.prompt_offsets[i]), int(self.prompt_offsets[i + 1])
        r0, r1 = int(self.response_offsets[i]), int(self.response_offsets[i + 1])
        s0, s1 = int(self.version_span_offsets[i]), int(self.version_span_offsets[i + 1])
        out = Sample(
            prompt_ids=self.prompt_ids[p0:p1],
            response_ids=self.response_ids[r0:r1],
            rollout_logp=self.rollout_logp[r0:r1],
            reward=float(self.rewards[i]),
            group_id=int(self.group_ids[i]),
            finish_reason=self.finish_reasons[i],
            version_spans=list(
                zip(
                    self.version_span_starts[s0:s1].tolist(),
                    self.version_span_versions[s0:s1].tolist(),
                    strict=True,
                )
            ),
        )
        if self.sampling_mask_offsets is not None and self.sampling_mask_ids is not None:
            offs = self.sampling_mask_offsets[r0 : r1 + 1]
            out.sampling_mask_ids = self.sampling_mask_ids[int(offs[0]) : int(offs[-1])]
            out.sampling_mask_offsets = offs - offs[0]
        if self.routing_offsets is not None and self.routed_experts is not None:
            out.routed_experts = self.routed_experts[
                int(self.routing_offsets[i]) : int(self.routing_offsets[i + 1])
            ]
        if self.old_logp is not None:
            out.old_logp = self.old_logp[r0:r1]
        if self.sampled is not None:
            out.sampled = self.sampled[r0:r1]
        return out

    def samples(self) -> Iterator[Sample]:
        """Iterate over per-sample views."""
        for i in range(self.num_samples):
            yield self.sample(i)

    # ---- building, selecting, concatenating ----------------------------------------------------
    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Sample],
        *,
        engine: str,
        quant_recipe: str,
        policy_version: int,
        num_experts: int | None = None,
    ) -> TrajectoryBatch:
        """Build a batch from per-sample tensors (``num_experts`` is required with routing)."""
        return _from_samples(samples, engine, quant_recipe, policy_version, num_experts)

    def select(self, indices: Sequence[int] | Tensor) -> TrajectoryBatch:
        """The samples at ``indices``, in that order (repeats allowed)."""
        return _select(self, torch.as_tensor(indices, dtype=torch.int64).reshape(-1))

    def slice(self, start: int, stop: int) -> TrajectoryBatch:
        """Samples ``start:stop`` as views (no copy); ``0 <= start <= stop <= num_samples``."""
        return _slice(self, start, stop)

    @staticmethod
    def concat(batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
        """Concatenate batches of one engine / quant recipe / routing shape.

        ``policy_version`` of the result is the newest of the inputs.
        """
        return _concat(batches)

    def replace(self, **changes: object) -> TrajectoryBatch:
        """A copy with some fields replaced (e.g. ``rewards=...``, ``old_logp=...``)."""
        return dataclasses.replace(self, **changes)


def _to_tensor(x: object, dtype: torch.dtype) -> Tensor:
    return torch.as_tensor(x).to(dtype).reshape(-1)


def _ragged_from_rows(rows: Sequence[object], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    tensors = [_to_tensor(r, dtype) for r in rows]
    offsets = ragged.offsets_from_lengths(torch.tensor([t.numel() for t in tensors], dtype=torch.int64))
    return (torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)), offsets


_SAMPLE_TENSORS = ("prompt_ids", "response_ids", "rollout_logp", "sampling_mask_ids", "sampling_mask_offsets",
                   "routed_experts", "old_logp", "sampled")  # fmt: skip


def check_on_cpu(samples: Sequence[Sample]) -> None:
    """Trajectories are CPU tensors (what crosses processes and lands on disk): an engine or
    worker moves its results to the CPU before it builds one. A device tensor is refused here,
    naming the field and the sample, rather than failing later in ``.numpy()``."""
    for i, s in enumerate(samples):
        for name in _SAMPLE_TENSORS:
            value = getattr(s, name)
            if isinstance(value, Tensor) and value.device.type != "cpu":
                raise TrajectoryError(
                    name, "trajectory tensors live on the CPU", sample=i, value=str(value.device),
                    expected="a CPU tensor (move engine outputs with .cpu() once per step)",
                )  # fmt: skip


def _from_samples(
    samples: Sequence[Sample], engine: str, quant_recipe: str, policy_version: int, num_experts: int | None
) -> TrajectoryBatch:
    check_on_cpu(samples)
    prompt_ids, prompt_offsets = _ragged_from_rows([s.prompt_ids for s in samples], torch.int32)
    response_ids, response_offsets = _ragged_from_rows([s.response_ids for s in samples], torch.int32)
    span_starts, span_offsets = _ragged_from_rows(
        [[a for a, _ in s.version_spans] for s in samples], torch.int64
    )
    batch = TrajectoryBatch(
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        response_ids=response_ids,
        response_offsets=response_offsets,
        rollout_logp=_ragged_from_rows([s.rollout_logp for s in samples], torch.float32)[0],
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.int64),
        finish_reasons=[s.finish_reason for s in samples],
        version_span_starts=span_starts,
        version_span_versions=torch.tensor(
            [v for s in samples for _, v in s.version_spans], dtype=torch.int64
        ),
        version_span_offsets=span_offsets,
        engine=engine,
        quant_recipe=quant_recipe,
        policy_version=int(policy_version),
    )
    _attach_optional(batch, samples, num_experts)
    return batch


def _require_all_or_none(samples: Sequence[Sample], name: str) -> bool:
    present = [getattr(s, name) is not None for s in samples]
    if any(present) and not all(present):
        missing = present.index(False)
        raise TrajectoryError(
            name,
            "present on some samples but missing on this one",
            sample=missing,
            expected="the field on every sample of a batch, or on none",
        )
    return bool(present) and all(present)


def _attach_optional(batch: TrajectoryBatch, samples: Sequence[Sample], num_experts: int | None) -> None:
    has_ids, has_offsets = (
        _require_all_or_none(samples, n) for n in ("sampling_mask_ids", "sampling_mask_offsets")
    )
    if has_ids != has_offsets:
        raise TrajectoryError(
            "sampling_mask_offsets", "sampling_mask_ids and sampling_mask_offsets come together"
        )
    if has_ids:
        parts = [
            (_to_tensor(s.sampling_mask_ids, torch.int32), _to_tensor(s.sampling_mask_offsets, torch.int64))
            for s in samples
        ]
        batch.sampling_mask_ids, batch.sampling_mask_offsets = ragged.concat(parts)
    if _require_all_or_none(samples, "old_logp"):
        batch.old_logp = torch.cat([_to_tensor(s.old_logp, torch.float32) for s in samples])
    if _require_all_or_none(samples, "sampled"):
        batch.sampled = torch.cat([_to_tensor(s.sampled, torch.bool) for s in samples])
    if _require_all_or_none(samples, "routed_experts"):
        if num_experts is None:
            raise TrajectoryError(
                "num_experts",
                "required when samples carry routed_experts",
                value=None,
                expected="the model's number of routed experts",
            )
        traces = [compact_routing(s.routed_experts, num_experts, sample=i) for i, s in enumerate(samples)]
        batch.routed_experts = torch.cat(traces)
        batch.routing_offsets = ragged.offsets_from_lengths(torch.tensor([t.shape[0] for t in traces]))
        batch.num_moe_layers, batch.topk = traces[0].shape[1], traces[0].shape[2]
        batch.num_experts = num_experts


def _select(batch: TrajectoryBatch, idx: Tensor) -> TrajectoryBatch:
    n = batch.num_samples
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"select: indices must lie in [0, {n}); got {idx.tolist()[:10]}")
    prompt_ids, prompt_offsets, _ = ragged.gather(batch.prompt_ids, batch.prompt_offsets, idx)
    response_ids, response_offsets, resp_pos = ragged.gather(batch.response_ids, batch.response_offsets, idx)
    starts, span_offsets, span_pos = ragged.gather(batch.version_span_starts, batch.version_span_offsets, idx)
    out = dataclasses.replace(
        batch,
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        response_ids=response_ids,
        response_offsets=response_offsets,
        rollout_logp=batch.rollout_logp[resp_pos],
        rewards=batch.rewards[idx],
        group_ids=batch.group_ids[idx],
        finish_reasons=[batch.finish_reasons[i] for i in idx.tolist()],
        version_span_starts=starts,
        version_span_versions=batch.version_span_versions[span_pos],
        version_span_offsets=span_offsets,
        old_logp=None if batch.old_logp is None else batch.old_logp[resp_pos],
        sampled=None if batch.sampled is None else batch.sampled[resp_pos],
    )
    if batch.sampling_mask_ids is not None and batch.sampling_mask_offsets is not None:
        out.sampling_mask_ids, out.sampling_mask_offsets, _ = ragged.gather(
            batch.sampling_mask_ids, batch.sampling_mask_offsets, resp_pos
        )
    if batch.routed_experts is not None and batch.routing_offsets is not None:
        out.routed_experts, out.routing_offsets, _ = ragged.gather(
            batch.routed_experts, batch.routing_offsets, idx
        )
    return out


def _slice_ragged(values: Tensor, offsets: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor, int, int]:
    """Rows ``start:stop`` as views: ``(values, rebased offsets, first value, end value)``."""
    lo, hi = int(offsets[start]), int(offsets[stop])
    return values[lo:hi], offsets[start : stop + 1] - lo, lo, hi


def _slice(batch: TrajectoryBatch, start: int, stop: int) -> TrajectoryBatch:
    if not 0 <= start <= stop <= batch.num_samples:
        raise IndexError(f"slice {start}:{stop} out of range for a batch of {batch.num_samples} samples")
    prompt_ids, prompt_offsets, _, _ = _slice_ragged(batch.prompt_ids, batch.prompt_offsets, start, stop)
    response_ids, response_offsets, r0, r1 = _slice_ragged(
        batch.response_ids, batch.response_offsets, start, stop
    )
    starts, span_offsets, v0, v1 = _slice_ragged(
        batch.version_span_starts, batch.version_span_offsets, start, stop
    )
    out = dataclasses.replace(
        batch,
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        response_ids=response_ids,
        response_offsets=response_offsets,
        rollout_logp=batch.rollout_logp[r0:r1],
        rewards=batch.rewards[start:stop],
        group_ids=batch.group_ids[start:stop],
        finish_reasons=batch.finish_reasons[start:stop],
        version_span_starts=starts,
        version_span_versions=batch.version_span_versions[v0:v1],
        version_span_offsets=span_offsets,
        old_logp=None if batch.old_logp is None else batch.old_logp[r0:r1],
        sampled=None if batch.sampled is None else batch.sampled[r0:r1],
    )
    if batch.sampling_mask_ids is not None and batch.sampling_mask_offsets is not None:
        out.sampling_mask_ids, out.sampling_mask_offsets, _, _ = _slice_ragged(
            batch.sampling_mask_ids, batch.sampling_mask_offsets, r0, r1
        )
    if batch.routed_experts is not None and batch.routing_offsets is not None:
        out.routed_experts, out.routing_offsets, _, _ = _slice_ragged(
            batch.routed_experts, batch.routing_offsets, start, stop
        )
    return out


def _check_compatible(batches: Sequence[TrajectoryBatch]) -> None:
    if not batches:
        raise TrajectoryError("batches", "nothing to concatenate", value=0, expected="at least one batch")
    first = batches[0]
    for b_idx, b in enumerate(batches[1:], start=1):
        for name in ("engine", "quant_recipe", "num_moe_layers", "num_experts", "topk"):
            if getattr(b, name) != getattr(first, name):
                raise TrajectoryError(
                    name,
                    f"batch {b_idx} differs from batch 0 in concat",
                    value=getattr(b, name),
                    expected=repr(getattr(first, name)),
                )
        for name in ("sampling_mask_ids", "routed_experts", "old_logp", "sampled"):
            if (getattr(b, name) is None) != (getattr(first, name) is None):
                raise TrajectoryError(
                    name,
                    f"present in only some batches (batch {b_idx} differs from batch 0)",
                    expected="the field in every batch or in none",
                )


def _concat(batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
    _check_compatible(batches)

    def cat(name: str) -> Tensor:
        return torch.cat([getattr(b, name) for b in batches])

    def rag(values: str, offsets: str) -> tuple[Tensor, Tensor]:
        return ragged.concat([(getattr(b, values), getattr(b, offsets)) for b in batches])

    first = batches[0]
    out = dataclasses.replace(
        first,
        policy_version=max(b.policy_version for b in batches),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
    )
    out.prompt_ids, out.prompt_offsets = rag("prompt_ids", "prompt_offsets")
    out.response_ids, out.response_offsets = rag("response_ids", "response_offsets")
    out.version_span_starts, out.version_span_offsets = rag("version_span_starts", "version_span_offsets")
    for name in ("rollout_logp", "rewards", "group_ids", "version_span_versions"):
        setattr(out, name, cat(name))
    if first.old_logp is not None:
        out.old_logp = cat("old_logp")
    if first.sampled is not None:
        out.sampled = cat("sampled")
    if first.sampling_mask_ids is not None:
        out.sampling_mask_ids, out.sampling_mask_offsets = rag("sampling_mask_ids", "sampling_mask_offsets")
    if first.routed_experts is not None:
        out.routed_experts, out.routing_offsets = rag("routed_experts", "routing_offsets")
    return out


def first_difference(a: TrajectoryBatch, b: TrajectoryBatch) -> str | None:
    """Name of the first field where ``a`` and ``b`` differ bit for bit (dtype included), else None."""
    for f in dataclasses.fields(TrajectoryBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and _bits(x).equal(_bits(y))
        else:
            same = x == y
        if not same:
            return f.name
    return None


def _bits(t: Tensor) -> Tensor:
    """An integer view of a tensor, so NaNs and signed zeros compare bit for bit."""
    if t.dtype.is_floating_point:
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


__all__ = [
    "FINISH_REASONS",
    "SCHEMA_VERSION",
    "Sample",
    "TrajectoryBatch",
    "first_difference",
]
