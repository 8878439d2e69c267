"""Packing trajectories into token-budgeted micro-batches (THD / varlen layout) and DP shards.

A micro-batch concatenates whole samples, each as ``prompt + response`` tokens, delimited by
``cu_seqlens``; ``position_ids`` restart at 0 per sample. Everything per response token
(``rollout_logp``, ``old_logp``, versions, the sampling mask rows) is gathered in packed order —
sample by sample, token by token — and ``response_positions`` says where each response token sits
in the packed sequence. The loss mask is aligned with *tokens*: ``loss_mask[p]`` is True when the
token at packed position ``p`` is a response token; the logit at ``p - 1`` predicts it (every
sample has a prompt, so ``p - 1`` stays inside the sample).

Routing (``[T, layers, k]``) is aligned with packed positions. Where a sample's trace stops one
token short (the engine never ran the last sampled token), the last position repeats the previous
row and ``routing_valid`` is False there; that position's output feeds no loss term.

A sample longer than the budget is an error naming it: never truncated, never dropped.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.data import ragged
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.trajectory import TrajectoryBatch


@dataclass(eq=False)
class MicroBatch:
    """Packed samples of one forward/backward pass. ``T`` packed tokens, ``R`` response tokens."""

    sample_indices: Tensor
    """int64 ``[n]``: indices of the packed samples in the source batch, in packed order."""
    input_ids: Tensor
    """int64 ``[T]``."""
    position_ids: Tensor
    """int64 ``[T]``, restarting at 0 for each sample."""
    cu_seqlens: Tensor
    """int32 ``[n + 1]``: sample boundaries (flash-attention varlen / Megatron THD)."""
    loss_mask: Tensor
    """bool ``[T]``: True where the token is a (sampled) response token (counts in the loss)."""
    response_positions: Tensor
    """int64 ``[R]``: packed position of every response token."""
    response_offsets: Tensor
    """int64 ``[n + 1]``: response tokens of packed sample ``i`` are ``[offsets[i], offsets[i+1])``."""
    response_token_index: Tensor
    """int64 ``[R]``: index of every response token in the source batch's flat response arrays."""
    rollout_logp: Tensor
    """float32 ``[R]``."""
    token_versions: Tensor
    """int64 ``[R]``: policy version that sampled each response token."""
    old_logp: Tensor | None = None
    """float32 ``[R]`` when the source batch has it."""
    sampling_mask_ids: Tensor | None = None
    """int32 kept ids, CSR over the ``R`` response tokens (rebased to this micro-batch)."""
    sampling_mask_offsets: Tensor | None = None
    """int64 ``[R + 1]``."""
    routed_experts: Tensor | None = None
    """``[T, layers, k]`` compact expert ids (uint8/uint16) per packed position."""
    routing_valid: Tensor | None = None
    """bool ``[T]``: False where the routing row is a filler (trace one token short)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch with every tensor on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if self.device == device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **moved)


def plan_microbatches(
    seq_lengths: Sequence[int], max_tokens_per_microbatch: int, *, num_microbatches: int | None = None
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens_per_microbatch`` tokens.

    First-fit decreasing. With ``num_microbatches`` the plan has exactly that many micro-batches
    (data-parallel ranks of one expert-parallel group must run the same count): the fullest bins
    are split until the count is reached; too few samples, or a budget that needs more
    micro-batches, is an error. Each micro-batch lists its samples in ascending order.
    """
    for i, length in enumerate(seq_lengths):
        if length > max_tokens_per_microbatch:
            raise TrajectoryError(
                "max_tokens_per_microbatch",
                "sample is longer than the token budget",
                sample=i,
                value=int(length),
                expected=f"<= {max_tokens_per_microbatch} tokens per sample",
            )
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seq_lengths)), key=lambda j: (-seq_lengths[j], j)):
        slot = next(
            (b for b, load in enumerate(loads) if load + seq_lengths[i] <= max_tokens_per_microbatch), None
        )
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        loads[slot] += seq_lengths[i]
    if num_microbatches is not None:
        bins = _split_to_count(bins, num_microbatches)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _split_to_count(bins: list[list[int]], count: int) -> list[list[int]]:
    if len(bins) > count:
        raise TrajectoryError(
            "num_microbatches",
            "the token budget needs more micro-batches",
            value=count,
            expected=f">= {len(bins)}",
        )
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda b: len(bins[b]), default=None)
        if largest is None or len(bins[largest]) < 2:
            raise TrajectoryError(
                "num_microbatches",
                "fewer samples than micro-batches",
                value=count,
                expected=f"<= {sum(len(b) for b in bins)}",
            )
        members = bins.pop(largest)
        bins += [members[0::2], members[1::2]]
    return bins


def pack_microbatches(
    batch: TrajectoryBatch, max_tokens_per_microbatch: int, *, num_microbatches: int | None = None
) -> list[MicroBatch]:
    """Pack ``batch`` into micro-batches under the token budget (see ``plan_microbatches``)."""
    plan = plan_microbatches(
        batch.sequence_lengths().tolist(), max_tokens_per_microbatch, num_microbatches=num_microbatches
    )
    versions = batch.token_versions()
    return [
        pack_samples(batch, torch.tensor(members, dtype=torch.int64), token_versions=versions)
        for members in plan
    ]


def _within(lengths: Tensor) -> Tensor:
    """For rows of the given lengths laid end to end: each element's index inside its row."""
    starts = ragged.offsets_from_lengths(lengths)[:-1]
    return torch.arange(int(lengths.sum())) - ragged.repeat(starts, lengths)


def pack_samples(
    batch: TrajectoryBatch, indices: Tensor, *, token_versions: Tensor | None = None
) -> MicroBatch:
    """Pack the samples ``indices`` (in that order) into one micro-batch, whatever its length."""
    prompt_len, resp_len = batch.prompt_lengths()[indices], batch.response_lengths()[indices]
    seq_len = prompt_len + resp_len
    cu = ragged.offsets_from_lengths(seq_len)
    prompt_values, _, _ = ragged.gather(batch.prompt_ids, batch.prompt_offsets, indices)
    resp_values, resp_offsets, resp_index = ragged.gather(batch.response_ids, batch.response_offsets, indices)
    prompt_pos = ragged.repeat(cu[:-1], prompt_len) + _within(prompt_len)
    resp_pos = ragged.repeat(cu[:-1] + prompt_len, resp_len) + _within(resp_len)
    input_ids = torch.empty(int(cu[-1]), dtype=torch.int64)
    input_ids[prompt_pos] = prompt_values.to(torch.int64)
    input_ids[resp_pos] = resp_values.to(torch.int64)
    if batch.sampled is not None:  # environment tokens stay context: not response tokens here
        keep = batch.sampled[resp_index]
        resp_offsets = ragged.offsets_from_lengths(ragged.row_sums(keep.to(torch.int64), resp_offsets))
        resp_pos, resp_index = resp_pos[keep], resp_index[keep]
    loss_mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    loss_mask[resp_pos] = True
    versions = batch.token_versions() if token_versions is None else token_versions
    mb = MicroBatch(
        sample_indices=indices.clone(),
        input_ids=input_ids,
        position_ids=_within(seq_len),
        cu_seqlens=cu.to(torch.int32),
        loss_mask=loss_mask,
        response_positions=resp_pos,
        response_offsets=resp_offsets,
        response_token_index=resp_index,
        rollout_logp=batch.rollout_logp[resp_index],
        token_versions=versions[resp_index],
        old_logp=None if batch.old_logp is None else batch.old_logp[resp_index],
    )
    if batch.sampling_mask_ids is not None and batch.sampling_mask_offsets is not None:
        mb.sampling_mask_ids, mb.sampling_mask_offsets, _ = ragged.gather(
            batch.sampling_mask_ids, batch.sampling_mask_offsets, resp_index
        )
    if batch.routed_experts is not None:
        mb.routed_experts, mb.routing_valid = _pack_routing(batch, indices, seq_len, mb.position_ids)
    return mb


def _pack_routing(
    batch: TrajectoryBatch, indices: Tensor, seq_len: Tensor, position_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """Routing rows per packed position; a missing last row repeats the previous one."""
    assert batch.routed_experts is not None and batch.routing_offsets is not None
    trace = batch.routed_experts
    trace_len = batch.routing_lengths()[indices]
    owner_trace_len = ragged.repeat(trace_len, seq_len)
    owner_start = ragged.repeat(batch.routing_offsets[:-1][indices], seq_len)
    valid = position_ids < owner_trace_len
    # A trace of length 0 (one prompt token, no response, vLLM convention) has no row to repeat:
    # point it at a filler row of distinct ids 0..k-1 appended after the trace.
    filler = torch.arange(trace.shape[2]).to(trace.dtype).expand(1, trace.shape[1], trace.shape[2])
    table = torch.cat([trace, filler])
    src = owner_start + torch.minimum(position_ids, owner_trace_len - 1)
    src = torch.where(owner_trace_len > 0, src, torch.full_like(src, trace.shape[0]))
    return table[src], valid


def split_balanced(batch: TrajectoryBatch, num_shards: int) -> list[Tensor]:
    """Split sample indices into ``num_shards`` data-parallel shards of near-equal token counts.

    Longest-processing-time greedy: samples by decreasing length, each to the lightest shard.
    Every shard gets at least one sample (fewer samples than shards is an error). Returns sorted
    int64 index tensors; use ``batch.select(indices)`` for the shard's batch.
    """
    if num_shards < 1 or batch.num_samples < num_shards:
        raise TrajectoryError(
            "num_shards",
            "need 1 <= num_shards <= num_samples",
            value=num_shards,
            expected=f"1..{batch.num_samples}",
        )
    lengths = batch.sequence_lengths().tolist()
    heap = [(0, 0, s) for s in range(num_shards)]  # (tokens, samples, shard)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        tokens, count, shard = heapq.heappop(heap)
        members[shard].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, shard))
    return [torch.tensor(sorted(m), dtype=torch.int64) for m in members]


@dataclass(frozen=True)
class RankShare:
    """One data-parallel rank's part of a rollout batch: its samples, mini-batch by mini-batch."""

    samples: list[int]
    """Samples of this rank in each mini-batch (its shard holds them in that order)."""
    micro_batches: list[int]
    """Micro-batches every rank packs its part of each mini-batch into (equal on all ranks:
    expert-parallel ranks meet in collectives in every forward)."""


@dataclass(frozen=True)
class ShardPlan:
    """How a rollout batch splits into optimizer steps and over data-parallel ranks.

    Mini-batch ``j`` is a contiguous range of the batch's samples (the same samples whatever the
    data-parallel size, so DP does not change what an optimizer step sees); each mini-batch is
    split over the ranks by token count (`split_balanced`).
    """

    indices: list[Tensor]
    """Per rank, the batch's sample indices it holds, mini-batch after mini-batch."""
    samples: list[list[int]]
    """Per rank, its sample count in each mini-batch."""
    micro_batches: list[int]
    """Per mini-batch, the micro-batch count of every rank."""

    def rank(self, dp_rank: int) -> RankShare:
        return RankShare(self.samples[dp_rank], self.micro_batches)


def plan_shards(
    batch: TrajectoryBatch, dp_size: int, max_tokens_per_microbatch: int, num_mini_batches: int
) -> ShardPlan:
    """Mini-batches of contiguous samples, each split over ``dp_size`` ranks by tokens; a micro-batch
    count per mini-batch that every rank can fill (see `ShardPlan`)."""
    total = batch.num_samples
    if num_mini_batches < 1 or total < num_mini_batches * dp_size:
        raise TrajectoryError(
            "num_mini_batches",
            "every data-parallel rank needs a sample in every mini-batch",
            value=num_mini_batches,
            expected=f"num_mini_batches x DP ({num_mini_batches} x {dp_size}) <= {total} samples",
        )
    bounds = [total * j // num_mini_batches for j in range(num_mini_batches + 1)]
    lengths = batch.sequence_lengths()
    per_rank: list[list[Tensor]] = [[] for _ in range(dp_size)]
    micro_batches = []
    for start, stop in itertools.pairwise(bounds):
        parts = [idx + start for idx in split_balanced(batch.slice(start, stop), dp_size)]
        counts = [len(plan_microbatches(lengths[p].tolist(), max_tokens_per_microbatch)) for p in parts]
        wanted, smallest = max(counts), min(len(p) for p in parts)
        if wanted > smallest:
            raise TrajectoryError(
                "num_microbatches",
                "a rank's part of a mini-batch has fewer samples than the micro-batches every rank runs",
                value=wanted,
                expected=f"<= {smallest} (raise trainer.max_tokens_per_microbatch or rollout.batch_size)",
            )
        micro_batches.append(wanted)
        for rank, part in enumerate(parts):
            per_rank[rank].append(part)
    return ShardPlan(
        indices=[torch.cat(parts) for parts in per_rank],
        samples=[[len(p) for p in parts] for parts in per_rank],
        micro_batches=micro_batches,
    )
