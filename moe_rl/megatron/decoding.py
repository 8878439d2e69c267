"""Step-by-step decoding of a Megatron GPT model: prefill the prompts, then one token per sequence.

Two decoders behind one interface (`Decoder`), both used by the Megatron rollout engine:

* `KVCacheDecoder`: incremental decoding through Megatron-core's own inference path, the static
  inference context (``megatron.core.inference.contexts.StaticInferenceContext``) that
  ``GPTModel.forward`` accepts. The context holds every attention layer's (GQA ``SelfAttention``
  and MLA alike) key and value buffers, indexed ``[slots, rows, groups, dim]``; each forward writes
  the new keys and values at the context's ``sequence_len_offset`` and attends over slots
  ``[0, offset + new)``. Cost per step: attention over the filled slots, the rest of the model on
  one token per row. The decoder allocates the buffers itself, before Megatron would on a layer's
  first call: sized from the batch (`KVCacheSize`; refused beyond ``rollout.megatron_kv_cache_gib``)
  and laid out ``[rows, groups, slots, dim]`` in memory, so that a step reads each row's cache as
  one block. The offset is one for the whole batch, so prompts are left-padded to the
  longest, P tokens: row i's prompt fills slots ``[pad_i, P)`` and its t-th response token slot
  ``P + t``. An attention mask (Megatron's convention: True = hidden) hides the slots before
  ``pad_i`` from every query of row i; a padding slot sees itself, so no softmax row is empty.
  RoPE (and YaRN) makes a query–key score depend on the distance between the two slots only,
  which padding leaves unchanged, so each row computes what it computes alone, up to float
  rounding. Without padding (prompts of one length) no mask is passed and Megatron's own causal
  prefill / unmasked decode runs. The masks need a core attention that applies an explicit mask
  in prefill and decode (`moe_rl.megatron.attention.SDPACoreAttention`, the local spec's);
  `kv_cache_unsupported` says why a model cannot.

  Rotated keys in the cache: by default Megatron's static path caches keys before RoPE and
  rotates the whole cache again at every step, work that grows with the context. With the
  model's ``flash_decode`` set it rotates each new key (and query) once, at its slot, and caches
  it rotated, the layout flash decoding reads; MLA caches rotated keys anyway. The context is
  left in prefill mode (``enable_decode_mode`` is not called), because Megatron's decode mode
  would hand flash-decode attention to flash-attn's kernel; a prefill-mode call of one token
  takes the same path as a decode step otherwise (a new key at ``sequence_len_offset``, no causal
  mask past the prefill). Without flash-attn, Megatron's rotary fallback for this path is wrong
  and `moe_rl.megatron.compat.apply_decoding_shims` replaces it.
* `RecomputeDecoder`: every step re-runs every sequence whole, as one packed sequence (``thd``):
  the reference the cached path is tested against, and the path for core attentions that ignore
  explicit masks (transformer-engine's).

Routing: with a `RoutingReplay`, each forward runs under RouterReplay RECORD and a step returns
the routing of the positions it computes for the first time (the prompts at prefill, the fed token
at each later step), so the routing of a position is the one its next token was sampled with.

Finished sequences leave the batch (`Decoder.keep`): the cached decoder moves the live rows of
every layer's buffers to the front (Megatron reads rows ``[0, rows)`` of its buffers) and stops
computing the others. Every tensor is created on the decoder's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from moe_rl.megatron.attention import SDPACoreAttention
from moe_rl.megatron.compat import apply_decoding_shims
from moe_rl.megatron.forward import forward_logits

if TYPE_CHECKING:
    from moe_rl.megatron.replay import RoutingReplay

GIB = 2**30


@dataclass
class Packed:
    """Token sequences as one packed sequence: the fields `forward_logits` reads from a micro-batch."""

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def pack_sequences(seqs: Sequence[list[int]], device: torch.device) -> Packed:
    """Token sequences as one packed sequence on ``device`` (built there from Python lists)."""
    lengths = [len(s) for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64, device=device).cumsum(0)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
    positions = torch.tensor([p for n in lengths for p in range(n)], dtype=torch.int64, device=device)
    return Packed(ids, positions, cu)


@dataclass
class StepOutput:
    """What one decoding step computed, on the model's device."""

    logits: Tensor
    """``[rows, V]``: each row's next-token logits (whole vocabulary)."""
    topk_idx_TLK: Tensor | None
    """``[Σ num_new, MoE layers, k]``: routing of the positions computed for the first time, row by
    row, positions in order (None without routing replay)."""
    num_new: list[int]
    """Positions of each row in `topk_idx_TLK`: its prompt length at prefill, 1 at later steps."""


class Decoder(Protocol):
    """Prefill once, then one token per row per step; rows are the unfinished sequences, in order."""

    def prefill(self, prompts: Sequence[list[int]], max_new_tokens: int) -> StepOutput:
        """Run the prompts; logits of the token after each."""
        ...

    def step(self, tokens: Sequence[int]) -> StepOutput:
        """Feed one token per row (the token each row sampled last); logits of the next."""
        ...

    def keep(self, rows: Sequence[int]) -> None:
        """Only ``rows`` (increasing indices of the current rows) go on decoding."""
        ...


def _recorded(replay: RoutingReplay | None, forward: Callable[[], Tensor]) -> tuple[Tensor, Tensor | None]:
    """``forward()``, under RouterReplay RECORD when ``replay`` is given: its output and the
    ``[tokens, MoE layers, k]`` routing it recorded."""
    if replay is None:
        return forward(), None
    with replay.record() as recording:
        out = forward()
    return out, recording.topk_idx_TLK


class RecomputeDecoder:
    """Every step runs every row's whole sequence as one packed sequence (see module docstring)."""

    def __init__(self, model: torch.nn.Module, replay: RoutingReplay | None, device: torch.device):
        self.model, self.replay, self.device = model, replay, device
        self.sequences: list[list[int]] = []

    def prefill(self, prompts: Sequence[list[int]], max_new_tokens: int) -> StepOutput:
        self.sequences = [list(p) for p in prompts]
        logits, trace, last = self._forward()
        return StepOutput(logits[last], trace, [len(s) for s in self.sequences])

    def step(self, tokens: Sequence[int]) -> StepOutput:
        for seq, token in zip(self.sequences, tokens, strict=True):
            seq.append(int(token))
        logits, trace, last = self._forward()
        return StepOutput(logits[last], None if trace is None else trace[last], [1] * len(tokens))

    def keep(self, rows: Sequence[int]) -> None:
        self.sequences = [self.sequences[i] for i in rows]

    def _forward(self) -> tuple[Tensor, Tensor | None, Tensor]:
        """Logits and routing of every packed token, and the index of each row's last token."""
        packed = pack_sequences(self.sequences, self.device)
        logits, trace = _recorded(self.replay, lambda: forward_logits(self.model, packed))
        return logits, trace, packed.cu_seqlens[1:].long() - 1


# ---------------------------------------------------------------------------------- the KV cache
def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Megatron attention modules (``Attention`` and its MLA subclasses), in order."""
    from megatron.core.transformer.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_slot(model: torch.nn.Module) -> int:
    """Bytes of cache one slot of one row takes: keys and values of every attention layer,
    ``groups × (key_hidden_size + val_hidden_size)`` elements of the model's dtype (the sizes of
    Megatron's own ``Attention._allocate_memory``)."""
    dtype = next(model.parameters()).dtype
    return sum(
        m.num_query_groups_per_partition * (m.key_hidden_size + m.val_hidden_size) * dtype.itemsize
        for m in attention_layers(model)
    )


def kv_cache_unsupported(model: torch.nn.Module) -> str | None:
    """Why `KVCacheDecoder` cannot decode ``model`` (None if it can): left padding needs a core
    attention that applies explicit masks in prefill and decode (`SDPACoreAttention`)."""
    other = sorted(
        {type(m.core_attention).__name__ for m in attention_layers(model)} - {SDPACoreAttention.__name__}
    )
    if not other:
        return None
    return (
        f"the model's core attention is {', '.join(other)}; KV-cached decoding passes left-padding "
        f"masks that only {SDPACoreAttention.__name__} (the local layer spec's, used without "
        "transformer-engine) applies in decode"
    )


@dataclass(frozen=True)
class KVCacheSize:
    """The cache of one batch: ``rows × slots × bytes_per_slot``."""

    rows: int
    slots: int
    """Longest prompt + max_new_tokens − 1 (the last sampled token is never fed)."""
    bytes_per_slot: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.slots * self.bytes_per_slot

    def check(self, limit_gib: float, max_new_tokens: int) -> None:
        """ValueError naming the numbers if the cache is larger than ``limit_gib``."""
        if self.nbytes <= limit_gib * GIB:
            return
        raise ValueError(
            f"the Megatron engine's KV cache for this generate call needs {self.nbytes / GIB:.3f} GiB: "
            f"{self.rows} sequences x {self.slots} slots (longest prompt {self.slots - max_new_tokens + 1} "
            f"+ max_new_tokens={max_new_tokens} - 1) x {self.bytes_per_slot} bytes per slot, more than "
            f"rollout.megatron_kv_cache_gib={limit_gib}; generate fewer sequences per call, lower "
            "max_new_tokens, or raise rollout.megatron_kv_cache_gib"
        )


class KVCacheDecoder:
    """Incremental decoding on Megatron's ``StaticInferenceContext`` (see module docstring)."""

    def __init__(
        self, model: torch.nn.Module, replay: RoutingReplay | None, device: torch.device, limit_gib: float
    ):
        reason = kv_cache_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        apply_decoding_shims()
        if not model.config.multi_latent_attention:
            model.config.flash_decode = True  # rotated keys in the cache (see module docstring)
        self.model, self.replay, self.device, self.limit_gib = model, replay, device, limit_gib
        self.bytes_per_slot = kv_bytes_per_slot(model)
        self.context = None
        self.pad: list[int] = []  # padding slots in front of each row's prompt (and on the device)
        self._pad = torch.zeros(0, dtype=torch.int64, device=device)

    def prefill(self, prompts: Sequence[list[int]], max_new_tokens: int) -> StepOutput:
        from megatron.core.inference.contexts import StaticInferenceContext

        width = max(len(p) for p in prompts)
        size = KVCacheSize(len(prompts), width + max_new_tokens - 1, self.bytes_per_slot)
        size.check(self.limit_gib, max_new_tokens)
        self.context = StaticInferenceContext(max_batch_size=size.rows, max_sequence_length=size.slots)
        self._allocate(size)
        self._set_pad([width - len(p) for p in prompts])
        tokens = torch.tensor(
            [[0] * pad + list(p) for pad, p in zip(self.pad, prompts)], dtype=torch.int64, device=self.device
        )
        slots = torch.arange(width, dtype=torch.int64, device=self.device)
        logits, trace = self._forward(tokens, slots, self._prefill_mask(slots))
        if trace is not None:  # recorded in Megatron's [slots, rows] order; keep the real slots, by row
            real = slots[None, :] >= self._pad[:, None]
            trace = trace.view(width, len(prompts), *trace.shape[1:]).transpose(0, 1)[real]
        return StepOutput(logits, trace, [len(p) for p in prompts])

    def step(self, tokens: Sequence[int]) -> StepOutput:
        slot = self.context.sequence_len_offset
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)[:, None]
        slots = torch.arange(slot, slot + 1, dtype=torch.int64, device=self.device)
        mask = None
        if any(self.pad):
            keys = torch.arange(slot + 1, dtype=torch.int64, device=self.device)
            mask = (keys[None, :] < self._pad[:, None])[:, None, None, :]
        logits, trace = self._forward(ids, slots, mask)
        return StepOutput(logits, trace, [1] * len(tokens))

    def keep(self, rows: Sequence[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        filled = self.context.sequence_len_offset
        for key, value in self.context.key_value_memory_dict.values():
            key[:filled, : len(rows)] = key[:filled, index]
            value[:filled, : len(rows)] = value[:filled, index]
        self._set_pad([self.pad[i] for i in rows])

    def _allocate(self, size: KVCacheSize) -> None:
        """Every attention layer's key and value buffers, before Megatron would allocate them:
        indexed ``[slots, rows, groups, dim]`` as Megatron does, but laid out ``[rows, groups, slots,
        dim]`` in memory, so that a decoding step reads each row's cached keys and values as one
        contiguous block (Megatron's own layout puts a row's consecutive slots ``rows × groups × dim``
        elements apart)."""
        dtype = next(self.model.parameters()).dtype

        def buffer(layer, dim: int) -> Tensor:
            groups = layer.num_query_groups_per_partition
            memory = torch.empty(size.rows, groups, size.slots, dim, dtype=dtype, device=self.device)
            return memory.permute(2, 0, 1, 3)

        for layer in attention_layers(self.model):
            self.context.key_value_memory_dict[layer.layer_number] = (
                buffer(layer, layer.key_hidden_size),
                buffer(layer, layer.val_hidden_size),
            )

    def _set_pad(self, pad: list[int]) -> None:
        self.pad = pad
        self._pad = torch.tensor(pad, dtype=torch.int64, device=self.device)

    def _prefill_mask(self, slots: Tensor) -> Tensor | None:
        """``[rows, 1, P, P]``, True where a query may not see a key: a later slot, or a padding
        slot other than the query's own. None without padding (Megatron's causal prefill)."""
        if not any(self.pad):
            return None
        causal = slots[None, :] <= slots[:, None]
        own = slots[None, :] == slots[:, None]
        real_key = slots[None, :] >= self._pad[:, None]
        seen = causal[None] & (real_key[:, None, :] | own[None])
        return ~seen[:, None]

    def _forward(self, tokens: Tensor, slots: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One forward of ``tokens`` ``[rows, new]`` at ``slots``: the last slot's logits ``[rows, V]``
        and the recorded routing; advances the context by ``new`` slots."""
        positions = (slots[None, :] - self._pad[:, None]).clamp(min=0)

        def forward() -> Tensor:
            return self.model(
                tokens, positions, mask, inference_context=self.context, runtime_gather_output=True
            )

        logits, trace = _recorded(self.replay, forward)
        self.context.increment_sequence_len_offset(tokens.shape[1])
        return logits[:, -1], trace
