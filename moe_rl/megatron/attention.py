"""`SDPACoreAttention`: Megatron core attention for the local layer spec, on packed sequences.

Used wherever transformer-engine is absent (the CPU, and CUDA machines without it). Megatron's
local ``DotProductAttention`` cannot serve the trainer there: it rejects packed (``thd``)
micro-batches, builds its causal mask with ``device="cuda"``
(``transformer.utils.get_default_causal_mask``) and forks the CUDA RNG tracker for dropout. This
module computes the same attention with ``torch.nn.functional.scaled_dot_product_attention``
and accepts packed micro-batches: the sequences given by ``cu_seqlens`` attend causally within
themselves only (run as a padded ``[sequences, max_len]`` batch with a causal key mask,
`PackedLayout`). Every tensor it creates is on the device of its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token sits in a padded ``[sequences, max_len]`` batch, and the mask.

    Tokens past ``cu_seqlens[-1]`` (padding) form one more sequence. Key 0 of every row stays
    visible so that no attention row is empty (an empty sequence's rows are never read back).
    """

    seq_id: Tensor
    """``[T]`` sequence of each token."""
    pos: Tensor
    """``[T]`` position of each token inside its sequence."""
    mask: Tensor
    """bool ``[sequences, 1, max_len, max_len]``: causal and key inside the sequence."""

    @staticmethod
    def build(cu_seqlens: Tensor, total: int, device: torch.device) -> PackedLayout:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        if int(cu[-1]) < total:
            cu = torch.cat([cu, torch.full((1,), total, dtype=torch.long, device=device)])
        lengths = cu[1:] - cu[:-1]
        seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        pos = torch.arange(total, device=device) - cu[seq_id]
        width = int(lengths.max()) if lengths.numel() else 1
        idx = torch.arange(width, device=device)
        key_ok = (idx[None, :] < lengths[:, None]) | (idx[None, :] == 0)
        mask = (idx[None, :] <= idx[:, None])[None] & key_ok[:, None, :]
        return PackedLayout(seq_id, pos, mask[:, None])

    @staticmethod
    def of(params, cu_seqlens: Tensor, total: int, device: torch.device) -> PackedLayout:
        """`build`'s layout, made once per packed batch: kept on its ``params`` (the one
        ``PackedSeqParams`` every layer of a forward is given) for the next layers. Building it
        waits for the device three times (the lengths are read on the host), so building it per layer
        stalled every layer of a forward on a GPU."""
        kept = getattr(params, "_packed_layout", None)
        if kept is not None and kept[0] is cu_seqlens and kept[1:3] == (total, device):
            return kept[3]
        layout = PackedLayout.build(cu_seqlens, total, device)
        params._packed_layout = (cu_seqlens, total, device, layout)
        return layout

    def pad(self, x: Tensor) -> Tensor:
        """``[T, heads, dim]`` -> ``[sequences, heads, max_len, dim]`` (zeros where no token)."""
        batch, width = self.mask.shape[0], self.mask.shape[-1]
        out = x.new_zeros(batch, width, *x.shape[1:])
        out[self.seq_id, self.pos] = x
        return out.transpose(1, 2)

    def unpad(self, x: Tensor) -> Tensor:
        """``[sequences, heads, max_len, dim]`` -> ``[T, heads * dim]``."""
        return x.transpose(1, 2)[self.seq_id, self.pos].flatten(1)


class SDPACoreAttention(torch.nn.Module):
    """Megatron core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Drop-in for ``DotProductAttention`` in the local layer spec (same constructor and forward
    signature): inputs ``[sq, b, heads, dim]`` (``sbhd``) or, with ``packed_seq_params`` in
    ``thd`` format, ``[tokens, heads, dim]``; output ``[sq, b, heads * v_dim]`` (``[tokens,
    heads * v_dim]`` when packed). Grouped-query attention repeats each key/value group over its
    ``heads / groups`` query heads, as Megatron does; a single query position (a decoding step
    over Megatron's KV cache) runs each group's heads as its queries instead. Softmax scale: the
    one given (MLA passes its own), else ``1/sqrt(kv_channels)``. Context parallelism is not
    supported (as in the local ``DotProductAttention``).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SDPACoreAttention does not support context parallelism, got context_parallel_size="
                f"{config.context_parallel_size}"
            )
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.current_max_attn_logits = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        **unused,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support an attention bias")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [sq, b, h, d] -> [b, h, sq, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        is_causal = attention_mask is None and getattr(mask_type, "name", "") == "causal"
        # Megatron masks are True where attention is NOT allowed; SDPA's are the opposite.
        sdpa_mask = None if attention_mask is None else ~attention_mask
        sq, b = query.shape[0], query.shape[1]
        if sq == 1:
            out = self._single_position(q, k, v, sdpa_mask, dropout)
        else:
            out = self._sdpa(q, k, v, sdpa_mask, is_causal, dropout)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params, dropout: float) -> Tensor:
        """Packed (``thd``) sequences, run as a padded batch of sequences: the cost is
        Σ_i max_len² per head instead of (Σ_i len_i)²."""
        cu_seqlens = (
            params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        )
        layout = PackedLayout.of(params, cu_seqlens, query.shape[0], query.device)
        q, k, v = (layout.pad(x) for x in (query, key, value))
        return layout.unpad(self._sdpa(q, k, v, layout.mask, False, dropout))

    def _single_position(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float
    ) -> Tensor:
        """One query position ``[b, heads, 1, dim]`` over keys and values ``[b, groups, S, dim]``:
        a decoding step over Megatron's KV cache (past the prefill Megatron asks for no causal
        mask; a one-token prefill has one key). The ``heads / groups`` query heads of a group run
        as that group's queries, so each cached key and value is read once per group instead of
        being copied for every head."""
        b, heads, _, dim = q.shape
        groups = k.shape[1]
        grouped = q.reshape(b, groups, heads // groups, dim)
        out = F.scaled_dot_product_attention(
            grouped, k, v, attn_mask=mask, dropout_p=dropout, scale=self.softmax_scale
        )
        return out.reshape(b, heads, 1, out.shape[-1])

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout: float
    ) -> Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.softmax_scale
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """No parameters, nothing to checkpoint."""
        return {}
