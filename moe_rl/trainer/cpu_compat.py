"""What Megatron-core 0.16.1 needs to run a GPT MoE on a machine without CUDA.

Used only when ``torch.cuda.is_available()`` is False; on GPU nodes nothing here is applied and
the transformer-engine specs run unchanged. Each shim is the smallest change that lets the
library's own code path run, and `apply_cpu_shims()` applies all of them, idempotently:

1. ``torch.cuda.current_device`` returns ``"cpu"``. Megatron calls it to place tensors (router
   gate weights in ``Router.gating``, expert-bias buffers in ``TopKRouter.__init__``, RoPE
   ``inv_freq`` in ``RotaryEmbedding.get_emb``, ``GlobalMemoryBuffer.get_tensor``, the DDP grad
   buffers); on a CPU build of torch the original raises ``AssertionError: Torch not compiled
   with CUDA enabled``. The replacement is only installed when CUDA is absent, where the
   original could never succeed.
2. ``torch.cuda.synchronize`` does nothing (there is no CUDA work to wait for). Megatron's
   checkpoint writer calls it unconditionally after staging tensors
   (``FileSystemWriterAsync.preload_tensors`` in ``dist_checkpointing/strategies/
   filesystem_async.py``), which otherwise fails ``dist_checkpointing.save`` on CPU.
3. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is bound to ``None``. The name is
   imported inside a ``try: import transformer_engine`` block only, while
   ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` unconditionally, so
   without transformer-engine every router forward raises ``NameError``. With ``None`` the
   function takes its own ``torch.mm`` branch.
4. ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` is set to False. Without
   transformer-engine, ``megatron.core.extensions.transformer_engine`` still imports and hands out
   ``MagicMock`` placeholders, so MLA's ``try`` import succeeds, ``HAVE_TE`` is True and
   ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError: isinstance() arg 2 must be a
   type`` while building ``MLASelfAttention``.
5. ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` become
   no-ops (an empty state). Activation recompute (``CheckpointFunction``) saves and restores the
   CPU *and* CUDA generator states around the recomputed forward; the CUDA half raises
   ``AssertionError: Torch not compiled with CUDA enabled``. The CPU generator is still saved
   and restored, so recomputed dropout draws the same numbers.
6. ``megatron.core.pipeline_parallel.schedules.torch`` becomes `_CPUFactoryTorch`, the torch
   module with ``zeros(..., device="cuda")`` placed on the CPU. The pipelined schedules count
   tokens in ``torch.zeros([], dtype=torch.int, device="cuda")`` (``total_num_tokens``); their
   point-to-point buffers already follow shim 1 (``torch.cuda.current_device()``). Only that
   module sees the proxy; everything else in it is plain torch.
7. `SDPACoreAttention`: a core-attention module for the local layer spec. Megatron's local
   ``DotProductAttention`` builds its causal mask with ``device="cuda"``
   (``transformer.utils.get_default_causal_mask``), forks the CUDA RNG tracker for dropout and
   rejects packed sequences. This module computes the same attention with
   ``torch.nn.functional.scaled_dot_product_attention`` and also accepts packed (``thd``)
   micro-batches: the sequences given by ``cu_seqlens`` attend causally within themselves only
   (run as a padded ``[sequences, max_len]`` batch with a causal key mask, `PackedLayout`).

Not a shim, but a CPU limit handled by the model builder: ``MoEAlltoAllTokenDispatcher``
creates a ``torch.cuda.Stream`` in its constructor (``RuntimeError: torch.cuda.Stream requires
CUDA support``), so on CPU the builder uses the ``allgather`` dispatcher
(`cpu_token_dispatcher`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

_CPU_DEVICE = "cpu"


def cuda_available() -> bool:
    """True where CUDA can be used (then no shim is applied)."""
    return torch.cuda.is_available()


def _cpu_current_device() -> str:
    """Stand-in for ``torch.cuda.current_device`` on machines without CUDA: the CPU."""
    return _CPU_DEVICE


def _shim_current_device() -> bool:
    if torch.cuda.current_device is _cpu_current_device:
        return False
    torch.cuda.current_device = _cpu_current_device
    return True


def _cpu_synchronize(device=None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` without CUDA: nothing is queued, nothing to wait for."""


def _shim_synchronize() -> bool:
    if torch.cuda.synchronize is _cpu_synchronize:
        return False
    torch.cuda.synchronize = _cpu_synchronize
    return True


def _shim_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    """Stand-in for Megatron's ``_get_cuda_rng_state`` without CUDA: an empty state."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    """Stand-in for Megatron's ``_set_cuda_rng_state`` without CUDA: nothing to set."""


def _shim_cuda_rng_state() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom._get_cuda_rng_state is _no_cuda_rng_state:
        return False
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_no_cuda_rng_state
    return True


def _shim_mla_have_te() -> bool:
    from megatron.core.transformer import multi_latent_attention

    if not multi_latent_attention.HAVE_TE or _transformer_engine_importable():
        return False
    multi_latent_attention.HAVE_TE = False
    return True


class _CPUFactoryTorch:
    """The ``torch`` module, except that ``zeros`` asked for a CUDA device gives a CPU tensor."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = _CPU_DEVICE
        return torch.zeros(*args, device=device, **kwargs)


def _shim_schedules_torch() -> bool:
    from megatron.core.pipeline_parallel import schedules

    if isinstance(schedules.torch, _CPUFactoryTorch):
        return False
    schedules.torch = _CPUFactoryTorch()
    return True


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def apply_cpu_shims() -> list[str]:
    """Apply every CPU shim not applied yet; returns the names of those applied by this call.

    Does nothing (returns ``[]``) where CUDA is available. Safe to call any number of times.
    """
    if cuda_available():
        return []
    applied = [
        name
        for name, shim in (
            ("torch.cuda.current_device", _shim_current_device),
            ("torch.cuda.synchronize", _shim_synchronize),
            ("moe_utils.te_general_gemm", _shim_te_general_gemm),
            ("multi_latent_attention.HAVE_TE", _shim_mla_have_te),
            ("tensor_parallel.random cuda rng state", _shim_cuda_rng_state),
            ("pipeline_parallel.schedules torch.zeros(device='cuda')", _shim_schedules_torch),
        )
        if shim()
    ]
    if applied:
        log.debug("CPU shims applied: %s", ", ".join(applied))
    return applied


def cpu_token_dispatcher(requested: str) -> str:
    """The Megatron token dispatcher to use without CUDA (``alltoall`` needs CUDA streams)."""
    if requested == "alltoall":
        log.info("no CUDA: moe_token_dispatcher_type 'alltoall' needs CUDA streams; using 'allgather'")
        return "allgather"
    return requested


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
            cu = torch.cat([cu, torch.tensor([total], device=device)])
        lengths = cu[1:] - cu[:-1]
        seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        pos = torch.arange(total, device=device) - cu[seq_id]
        width = int(lengths.max()) if lengths.numel() else 1
        idx = torch.arange(width, device=device)
        key_ok = (idx[None, :] < lengths[:, None]) | (idx[None, :] == 0)
        mask = (idx[None, :] <= idx[:, None])[None] & key_ok[:, None, :]
        return PackedLayout(seq_id, pos, mask[:, None])

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
    ``heads / groups`` query heads, as Megatron does. Softmax scale: the one given (MLA passes
    its own), else ``1/sqrt(kv_channels)``. Context parallelism is not supported (as in the
    local ``DotProductAttention``).
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
        out = self._sdpa(q, k, v, sdpa_mask, is_causal, dropout)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params, dropout: float) -> Tensor:
        """Packed (``thd``) sequences, run as a padded batch of sequences: the cost is
        Σ_i max_len² per head instead of (Σ_i len_i)²."""
        cu_seqlens = (
            params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        )
        layout = PackedLayout.build(cu_seqlens, query.shape[0], query.device)
        q, k, v = (layout.pad(x) for x in (query, key, value))
        return layout.unpad(self._sdpa(q, k, v, layout.mask, False, dropout))

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
