"""The sending side of a weight sync: which trainer rank sends which tensor, as a bucket stream.

Every rank of the trainer group iterates its tensors together (tensor-parallel shards are
all-gathered, a collective), and one rank per distinct tensor sends it:

* a dense tensor (attention, norms, shared experts, embeddings, the LM head): the rank with data-
  parallel rank 0 (context parallel included) and tensor-parallel rank 0 of its pipeline stage;
* an expert tensor: the rank with expert-data-parallel rank 0 and expert-tensor-parallel rank 0
  of its expert-parallel group, so each expert-parallel rank sends its own experts.

So each pipeline stage and each expert-parallel rank sends what it owns, nobody sends a tensor
twice, and no rank gathers more than one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moe_rl.weight_sync.buckets import Bucket, BucketPacker
from moe_rl.weight_sync.wire import WireEncoder

EXPERT_MARK = ".mlp.experts."


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


def weight_groups(model: torch.nn.Module, encoder: WireEncoder) -> Iterator[list]:
    """What this rank sends, encoded, one Megatron tensor (all its HF pieces) at a time."""
    from moe_rl.megatron.hf_weights import iter_hf_weight_groups

    for _, group in iter_hf_weight_groups(model, select=sends, copy=False):  # the packer copies
        yield encoder.encode_group(group)


def stream_buckets(
    model: torch.nn.Module,
    encoder: WireEncoder,
    capacity: int,
    rank: int = 0,
    packer: BucketPacker | None = None,
) -> Iterator[Bucket]:
    """This rank's buckets (none on ranks that own nothing; they still join the gathers). Each
    bucket is valid until the next is requested (`buckets.BucketPacker`); pass the rank's own
    ``packer`` to reuse its buffer from sync to sync."""
    packer = packer or BucketPacker(capacity, sender=rank)
    return packer.pack(weight_groups(model, encoder))
