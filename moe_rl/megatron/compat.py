"""What Megatron-core 0.16 needs where transformer-engine or CUDA is missing, applied once per process.

Each shim is the smallest change that lets the library's own code path run, and is keyed on what
is missing, not on the machine: `shims_for` chooses them from two facts (does this process see
CUDA, does ``transformer_engine`` import), and `apply_process_shims` applies that choice once,
at process setup (`moe_rl.megatron.parallel.init_parallel`, which every process that builds a
Megatron model goes through first). Building a model applies nothing; it checks that the setup
ran (`require_process_setup`).

Without transformer-engine (on the CPU and on CUDA machines without it):

1. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is bound to ``None``. The name is
   imported inside a ``try: import transformer_engine`` block only, while
   ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` unconditionally, so
   without transformer-engine every router forward raises ``NameError``. With ``None`` the
   function takes its own ``torch.mm`` branch.
2. ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` is set to False. Without
   transformer-engine, ``megatron.core.extensions.transformer_engine`` still imports and hands out
   ``MagicMock`` placeholders, so MLA's ``try`` import succeeds, ``HAVE_TE`` is True and
   ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError: isinstance() arg 2 must be a
   type`` while building ``MLASelfAttention``.

Without CUDA (only there: on a CUDA machine the originals are right):

3. ``torch.cuda.current_device`` returns ``"cpu"``. Megatron calls it to place tensors (router
   gate weights in ``Router.gating``, expert-bias buffers in ``TopKRouter.__init__``, RoPE
   ``inv_freq`` in ``RotaryEmbedding.get_emb``, ``GlobalMemoryBuffer.get_tensor``, the DDP grad
   buffers); on a CPU build of torch the original raises ``AssertionError: Torch not compiled
   with CUDA enabled``.
4. ``torch.cuda.synchronize`` does nothing (there is no CUDA work to wait for). Megatron's
   checkpoint writer calls it unconditionally after staging tensors
   (``FileSystemWriterAsync.preload_tensors`` in ``dist_checkpointing/strategies/
   filesystem_async.py``), which otherwise fails ``dist_checkpointing.save`` on CPU.
5. ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` become
   no-ops (an empty state). Activation recompute (``CheckpointFunction``) saves and restores the
   CPU *and* CUDA generator states around the recomputed forward; the CUDA half raises
   ``AssertionError: Torch not compiled with CUDA enabled``. The CPU generator is still saved
   and restored, so recomputed dropout draws the same numbers.
6. ``megatron.core.pipeline_parallel.schedules.torch`` becomes `_CPUFactoryTorch`, the torch
   module with ``zeros(..., device="cuda")`` placed on the CPU. The pipelined schedules count
   tokens in ``torch.zeros([], dtype=torch.int, device="cuda")`` (``total_num_tokens``); their
   point-to-point buffers already follow shim 3. Only that module sees the proxy.

Without flash-attn, for incremental decoding only (applied by
`moe_rl.megatron.decoding.KVCacheDecoder`, which alone uses that path):

7. ``megatron.core.models.common.embeddings.rope_utils.apply_rotary_emb_flash`` becomes
   `rotary_with_cos_sin`, flash-attn's ``apply_rotary_emb`` written in torch. Megatron's static
   inference context keeps rotated keys in its cache when ``flash_decode`` is set, rotating each
   new key (and query) with ``apply_rotary_pos_emb_with_cos_sin``; without flash-attn that function
   falls back to ``_apply_rotary_pos_emb_bshd`` with the cosines and sines as if they were angles
   (it takes their cosines again), which is wrong.

Not shims, but limits the model builder handles: without CUDA, ``MoEAlltoAllTokenDispatcher``
creates a ``torch.cuda.Stream`` in its constructor (``RuntimeError: torch.cuda.Stream requires
CUDA support``), so the ``allgather`` dispatcher is used (`token_dispatcher`); without
transformer-engine the local layer spec with `moe_rl.megatron.attention.SDPACoreAttention` is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from moe_rl.config.modes import Dispatcher, ExpertGemm

log = logging.getLogger(__name__)

_CPU_DEVICE = "cpu"

Missing = Literal["transformer_engine", "cuda"]


def cuda_available() -> bool:
    """True where this process sees CUDA (see `moe_rl.device`)."""
    return torch.cuda.is_available()


def transformer_engine_importable() -> bool:
    """True where ``transformer_engine`` imports."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def te_available() -> bool:
    """Whether Megatron's transformer-engine layer specs can be used: CUDA and transformer-engine."""
    return cuda_available() and transformer_engine_importable()


def expert_gemm(requested: ExpertGemm) -> ExpertGemm:
    """The expert products this process runs for ``trainer.expert_gemm``: ``auto`` is
    transformer-engine's grouped GEMM where `te_available`, torch's otherwise; ``te`` where it is
    not available is refused, naming the key."""
    if requested == ExpertGemm.AUTO:
        return ExpertGemm.TE if te_available() else ExpertGemm.TORCH
    if requested == ExpertGemm.TE and not te_available():
        raise ValueError(
            "trainer.expert_gemm=te: transformer-engine's grouped GEMM needs CUDA and transformer-engine, "
            "which this process does not have; use auto or torch"
        )
    return requested


def token_dispatcher(requested: Dispatcher) -> str:
    """The Megatron token dispatcher this process can build (``alltoall`` needs CUDA streams), as
    the plain string Megatron's config takes."""
    if requested == Dispatcher.ALLTOALL and not cuda_available():
        log.info("no CUDA: moe_token_dispatcher_type 'alltoall' needs CUDA streams; using 'allgather'")
        return str(Dispatcher.ALLGATHER)
    return str(requested)


# ---------------------------------------------------------------------------------- the shims
def _shim_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _shim_mla_have_te() -> bool:
    from megatron.core.transformer import multi_latent_attention

    if not multi_latent_attention.HAVE_TE:
        return False
    multi_latent_attention.HAVE_TE = False
    return True


def _cpu_current_device() -> str:
    """Stand-in for ``torch.cuda.current_device`` without CUDA: the CPU."""
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


def _no_cuda_rng_state(*args, **kwargs) -> Tensor:
    """Stand-in for Megatron's ``_get_cuda_rng_state`` without CUDA: an empty state."""
    return torch.empty(0, dtype=torch.uint8, device=_CPU_DEVICE)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    """Stand-in for Megatron's ``_set_cuda_rng_state`` without CUDA: nothing to set."""


def _shim_cuda_rng_state() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom._get_cuda_rng_state is _no_cuda_rng_state:
        return False
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_no_cuda_rng_state
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


def rotary_with_cos_sin(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False
) -> Tensor:
    """flash-attn's ``apply_rotary_emb`` (shim 7): ``x`` ``[batch, seq, heads, dim]``, ``cos``,
    ``sin`` ``[seq, rot / 2]``; the first ``rot`` dims of each head become
    ``x·cos + rotate_half(x)·sin`` (halves, or adjacent pairs when ``interleaved``), the operations of
    Megatron's unfused RoPE (``_apply_rotary_pos_emb_bshd``), so the values are the same."""
    rot, seq = 2 * cos.shape[-1], x.shape[1]
    if interleaved:
        cos, sin = (c[:seq].repeat_interleave(2, dim=-1) for c in (cos, sin))
        t, t_pass = x[..., :rot], x[..., rot:]
        rotated = torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    else:
        cos, sin = (torch.cat((c[:seq], c[:seq]), dim=-1) for c in (cos, sin))
        t, t_pass = x[..., :rot], x[..., rot:]
        half1, half2 = torch.chunk(t, 2, dim=-1)
        rotated = torch.cat((-half2, half1), dim=-1)
    cos, sin = (c[None, :, None, :].to(x.dtype) for c in (cos, sin))
    return torch.cat((t * cos + rotated * sin, t_pass), dim=-1)


def apply_decoding_shims() -> list[str]:
    """Shim 7 where flash-attn's rotary kernel is missing; returns its name if this call applied it."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.apply_rotary_emb_flash is not None:
        return []
    rope_utils.apply_rotary_emb_flash = rotary_with_cos_sin
    log.debug("Megatron compatibility shim applied: rope_utils.apply_rotary_emb_flash")
    return ["rope_utils.apply_rotary_emb_flash"]


@dataclass(frozen=True)
class Shim:
    """One workaround: what it patches, which missing component calls for it, how to apply it."""

    name: str
    missing: Missing
    apply: Callable[[], bool]
    """Applies the shim; False if it was in place already."""


SHIMS: tuple[Shim, ...] = (
    Shim("moe_utils.te_general_gemm", "transformer_engine", _shim_te_general_gemm),
    Shim("multi_latent_attention.HAVE_TE", "transformer_engine", _shim_mla_have_te),
    Shim("torch.cuda.current_device", "cuda", _shim_current_device),
    Shim("torch.cuda.synchronize", "cuda", _shim_synchronize),
    Shim("tensor_parallel.random cuda rng state", "cuda", _shim_cuda_rng_state),
    Shim("pipeline_parallel.schedules torch.zeros(device='cuda')", "cuda", _shim_schedules_torch),
)


def shims_for(cuda: bool, transformer_engine: bool) -> list[Shim]:
    """The shims a process needs, from what it has: the transformer-engine ones wherever
    transformer-engine does not import, the CUDA ones only where CUDA is absent."""
    missing = {"cuda"} if not cuda else set()
    if not transformer_engine:
        missing.add("transformer_engine")
    return [shim for shim in SHIMS if shim.missing in missing]


_setup_done = False


def apply_process_shims() -> list[str]:
    """Apply the shims this process needs (`shims_for`), once; returns the names applied by this
    call. Safe to call any number of times."""
    global _setup_done
    chosen = shims_for(cuda_available(), transformer_engine_importable())
    applied = [shim.name for shim in chosen if shim.apply()]
    _setup_done = True
    if applied:
        log.debug("Megatron compatibility shims applied: %s", ", ".join(applied))
    return applied


def require_process_setup() -> None:
    """Raise unless `apply_process_shims` ran in this process (through ``init_parallel``)."""
    if not _setup_done:
        raise RuntimeError(
            "Megatron process setup has not run: call moe_rl.megatron.parallel.init_parallel() before "
            "building a model"
        )
