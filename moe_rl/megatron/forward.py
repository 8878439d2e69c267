"""One forward of a Megatron GPT model over a packed micro-batch: the logits, whole-vocabulary.

Shared by the trainer's log-prob passes and the Megatron engine. A micro-batch is one packed
sequence (Megatron ``thd`` layout: tokens ``[1, T]``, ``position_ids`` restarting per sample,
``PackedSeqParams`` with ``cu_seqlens``); attention stays inside each sample (transformer-engine's
attention on GPU nodes, `moe_rl.megatron.attention.SDPACoreAttention` without it). Padding is added
only where ranks must agree on the token count (`pad_micro_batch`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.data.packing import MicroBatch


def pad_micro_batch(micro: MicroBatch, pad_to: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, position_ids, cu_seqlens)`` with ``pad_to - T`` padding tokens appended as
    one extra sequence (token id 0). Used where ranks must run equal token counts: Megatron's
    allgather token dispatcher gathers equal-sized blocks over the expert-parallel group."""
    tokens, positions, cu = micro.input_ids, micro.position_ids, micro.cu_seqlens.to(torch.int32)
    extra = 0 if pad_to is None else pad_to - tokens.numel()
    if extra < 0:
        raise ValueError(f"pad_to={pad_to} is shorter than the micro-batch ({tokens.numel()} tokens)")
    if extra == 0:
        return tokens, positions, cu
    device = tokens.device
    tokens = torch.cat([tokens, torch.zeros(extra, dtype=tokens.dtype, device=device)])
    positions = torch.cat([positions, torch.arange(extra, dtype=positions.dtype, device=device)])
    cu = torch.cat([cu, torch.full((1,), pad_to, dtype=torch.int32, device=cu.device)])
    return tokens, positions, cu


def packed_seq_params(cu_seqlens: Tensor):
    """Megatron ``PackedSeqParams`` (``thd``) for packed sequences delimited by ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )


def forward_logits(model: torch.nn.Module, micro: MicroBatch) -> Tensor:
    """Logits ``[T, V]`` of the packed micro-batch (last pipeline stage), unpadded.

    The micro-batch must be on the model's device already (the caller owns that boundary).

    With tensor parallelism the output layer gives each rank a slice of the vocabulary; the slices
    are all-gathered (differentiably: the backward keeps each rank's slice of the gradient), so
    the vocabulary reductions see the whole vocabulary on every rank.
    """
    check_on_model_device(micro, model)
    tokens, positions, cu = pad_micro_batch(micro, None)
    logits = model(
        tokens[None], positions[None], attention_mask=None, packed_seq_params=packed_seq_params(cu)
    )
    logits = whole_vocab(logits)
    return logits.reshape(-1, logits.shape[-1])[: micro.num_tokens]


def check_on_model_device(micro, model: torch.nn.Module) -> None:
    """Refuse a micro-batch that is not on the model's device (the caller moves it, once)."""
    device = next(model.parameters()).device
    if micro.input_ids.device != device:
        raise ValueError(
            f"micro-batch input_ids are on {micro.input_ids.device}, the model on {device}: move the "
            "micro-batch to the model's device at the worker's boundary (MicroBatch.to)"
        )


def _tp_world_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def whole_vocab(logits: Tensor) -> Tensor:
    """Vocab-parallel logits all-gathered over the TP group (differentiably); as is without TP."""
    if _tp_world_size() == 1:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)
