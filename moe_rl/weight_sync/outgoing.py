"""What a trainer rank sends in a sync: which rank sends which tensor (`sends`), the tensors as they leave the
model (`owned`, or `whole_model` on the routes that send a rank's whole model), and each sync's `Outgoing`.
Every rank iterates its tensors together (tensor-parallel shards are all-gathered) and one rank per tensor
sends it: a dense one, data-parallel (context parallel included) and tensor-parallel rank 0 of its pipeline
stage; an expert's, expert-data- and expert-tensor-parallel rank 0 of its expert-parallel group.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.weight_sync.wire import LazyGroup, WireEncoder

EXPERT_MARK = ".mlp.experts."
_EXPERT = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")

FLOAT32_WEIGHTS = ("e_score_correction_bias",)
"""Weights vLLM holds in float32 whatever the engine's dtype (the expert-score bias that routes)."""


def engine_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the dtype a vLLM engine of ``dtype`` holds weight ``name`` in."""
    if tensor.is_floating_point():
        return tensor.to(torch.float32 if name.endswith(FLOAT32_WEIGHTS) else dtype)
    return tensor


def sends(megatron_name: str) -> bool:
    """Whether this rank is the one that sends ``megatron_name`` (see the module docstring)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    if EXPERT_MARK in megatron_name:
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )


Groups = Iterator[list[tuple[str, torch.Tensor]]]
"""HF-named tensors, one Megatron tensor (all its pieces) at a time."""


def owned(model: torch.nn.Module, part: SyncPart | None = None) -> Groups:
    """The tensors this rank sends (`sends`), as views; every rank iterates (the gathers are collectives)."""
    from moe_rl.megatron.hf_weights import iter_hf_weight_groups

    part = part or SyncPart()
    groups = iter_hf_weight_groups(model, select=sends, copy=False, adapters=part.adapters, part=part.only)
    for _, group in groups:  # views; the packer writes
        yield group


@dataclass(frozen=True)
class SyncPart:
    """Which of the model's tensors one sync carries: ``adapters`` LoRA's adapters apart and each
    weight as it is (else each weight merged with its adapter); ``only(megatron_name)`` the tensors
    in it (None: all; the same on every rank)."""

    adapters: bool = False
    only: Callable[[str], bool] | None = None


def whole_model(
    model: torch.nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    select: Callable[[str], bool] | None = None, root: bool = True, part: SyncPart | None = None,
) -> Groups:  # fmt: skip
    """Every tensor of the model, one Megatron tensor at a time, gathered (each expert over the
    expert-parallel group, a group of pieces per expert-parallel rank); every rank iterates, a ``root``
    yields. ``dtype``: what tensors are cast to (None: kept); ``device``: where gathered (the model's);
    ``select(megatron_name)``: what this rank takes part for; ``part``: what the sync carries
    (`SyncPart`). Needs Megatron's parallel groups (`iter_hf_weight_groups`), and one pipeline stage."""
    from megatron.core import parallel_state as ps

    from moe_rl.megatron.hf_weights import iter_hf_weight_groups

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("sending the whole model from a rank needs one pipeline stage")
    device = next(model.parameters()).device if device is None else torch.device(device)
    ep = ps.get_expert_model_parallel_world_size()
    group = ps.get_expert_model_parallel_group()
    local = _num_experts(model) // ep
    part = part or SyncPart()
    for _, pieces in iter_hf_weight_groups(
        model, select=select, copy=False, adapters=part.adapters, part=part.only
    ):
        peers: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(ep)]  # what each EP rank holds
        for name, piece in pieces:
            piece = (piece if dtype is None else engine_dtype(name, piece, dtype)).to(device)
            if ep > 1 and _EXPERT.search(name):  # every expert-parallel rank holds its own experts
                gathered = [torch.empty_like(piece) for _ in range(ep)]
                dist.all_gather(gathered, piece.contiguous(), group=group)
                for rank, got in enumerate(gathered):
                    peers[rank].append((_peer_expert(name, rank, local), got))
            else:
                peers[0].append((name, piece))
        if root:
            yield from (held for held in peers if held)


def _num_experts(model: torch.nn.Module) -> int:
    while hasattr(model, "module"):  # DDP and precision wrappers
        model = model.module
    return int(getattr(model.config, "num_moe_experts", None) or 1)


def _peer_expert(name: str, rank: int, local: int) -> str:
    """The HF name of the expert that expert-parallel rank ``rank`` holds where this rank holds the one of
    ``name`` (each rank holds ``local`` consecutive experts, rank 0 the first)."""
    match = _EXPERT.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert's weight")
    own = int(match.group(2))
    return f"{name[: match.start(2)]}{own % local + rank * local}{name[match.end(2) :]}"


class Outgoing:
    """What one trainer rank sends in one sync: ``tensors`` (`owned` or `whole_model`, started once) encoded
    by ``encoder`` (`groups`), or only its part in the gathers (`join_gathers`)."""

    def __init__(
        self, tensors: Callable[[], Groups], encoder: WireEncoder, model: torch.nn.Module | None = None
    ):
        """``model``: the trainer's model (vLLM's transfer reads it itself)."""
        self._tensors, self.encoder, self.model = tensors, encoder, model

    @functools.cached_property
    def _stream(self) -> Groups:
        return self._tensors()

    def groups(self, max_bytes: int | None = None) -> Iterator[LazyGroup]:
        """What travels, one group at a time (`WireEncoder.lazy_groups`, chunked past ``max_bytes``)."""
        for group in self._stream:
            yield from self.encoder.lazy_groups(group, max_bytes)

    def join_gathers(self) -> None:
        """Take part in the rest of this sync's gathers (all of them before `groups`), sending nothing."""
        for _ in self._stream:
            pass
