"""The rollout quantization recipe on the wire: what travels for each weight, and what it decodes to.

The sender applies the recipe (`WireEncoder`), so a quantized recipe moves quantized bytes:

* ``fp8`` (``fp8_block128``, ``fp8_tensor``, channel): e4m3 data plus fp32 scales, one per block
  (the block of ``tensor`` granularity is the whole tensor, of ``channel`` a row). The block-FP8
  layout is vLLM's (``weight`` + ``weight_scale_inv``) and comes from
  `moe_rl.quant.fp8_block.quantize_fp8_block` (a fused kernel on CUDA). ``scale = amax / 448``,
  ``data = e4m3(x / scale)``; a block whose scale is 0 sends zeros.
* ``int8``: int8 data ``round(x / scale)`` clamped to ±127 and fp32 scales ``amax / 127`` per row
  (``channel``) or per tensor.
* everything else (``none``, and the recipes that need the receiver: ``int4_awq`` calibrates on the
  engine's own rollouts, ``nvfp4`` fake-quantizes there through ModelOpt): the tensor itself.

Weights the recipe leaves alone (routers, embeddings, the LM head, norms, excluded layers) travel as
they are. `decode` turns what arrived into the values a quantized engine holds (``data · scale``
blockwise, in float32), which is what an engine that fake-quantizes (the Megatron engine) computes
with. Engines that quantize themselves (vLLM's online quantization) are sent the tensors as they
are (``quantized_wire=False``). The sender also fills the sync's `QuantReport` (relative error of
what the engine will hold, bytes sent). On CPU, block FP8 of a large weight of whole blocks is
encoded and decoded by the fused kernels of `moe_rl.quant.fused`.

A weight larger than a bucket travels in row chunks (`WireEncoder.lazy_groups`: whole blocks of
rows when quantized, so each chunk carries exactly the bytes of those rows of the whole weight);
the receiver's `Rejoin` writes each chunk into the weight (or a tensor of its own) and hands the
weight on with its last chunk.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.config.modes import QuantMethod
from moe_rl.config.schema import QuantConfig
from moe_rl.config.sync_plan import WIRE_METHODS
from moe_rl.device import copy_into
from moe_rl.quant.codec import block_of, dequantize, quantize_into, scale_shape
from moe_rl.quant.recipes import QuantReport, should_quantize


def scale_name(weight_name: str) -> str:
    """Name the scales of ``weight_name`` travel under (vLLM's block-FP8 checkpoint name)."""
    return weight_name.removesuffix(".weight") + ".weight_scale_inv"


@dataclass(frozen=True, eq=False)
class Piece:
    """One tensor that travels, before its bytes exist: name, dtype, shape and wire meta."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    meta: dict
    source: Tensor | None = None
    """The tensor itself, when it travels as it is (a packer may then carry it as it lies instead of
    copying it: see `moe_rl.weight_sync.buckets.BucketPacker`)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Writer = Callable[[Sequence[Tensor | None]], None]
"""Writes what travels for a tensor (or rows of it) into its pieces' views in a bucket."""


@dataclass
class LazyGroup:
    """A group's pieces and how to write them: ``fill(views)`` writes each piece into its view (a
    tensor of the piece's dtype and shape in the bucket; None for a piece with a ``source`` that the
    packer sends where it lies), so what travels is computed straight into the bucket, with no
    encoded copy of the group besides it."""

    pieces: list[Piece]
    fill: Writer

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)

    @staticmethod
    def of(items: Sequence[tuple[str, Tensor, dict]]) -> LazyGroup:
        """Tensors that already exist, copied into the bucket as they are."""
        pieces = [Piece(name, t.dtype, tuple(t.shape), meta, t) for name, t, meta in items]
        return LazyGroup(pieces, lambda views: _copy_all([t for _, t, _ in items], views))


def _copy_all(tensors: Sequence[Tensor], views: Sequence[Tensor | None]) -> None:
    for tensor, view in zip(tensors, views, strict=True):
        _copy_unless_sent_in_place(view, tensor)


def _copy_unless_sent_in_place(view: Tensor | None, tensor: Tensor) -> None:
    if view is not None:
        copy_into(view, tensor)


class WireEncoder:
    """The sender's side: HF-named tensors -> what travels, with the sync's `QuantReport`."""

    def __init__(self, cfg: QuantConfig, num_layers: int, quantized_wire: bool = True):
        self.cfg, self.num_layers = cfg, num_layers
        self.active = quantized_wire and cfg.method in WIRE_METHODS
        self.report = QuantReport(cfg.name)

    def lazy_group(self, group: Iterable[tuple[str, Tensor]]) -> LazyGroup:
        """What travels for ``group``, written into the bucket by the packer: a quantized weight as its
        data and scales (``<name>_scale_inv``), straight into their place (block FP8 on CPU without any
        full-size temporary), other tensors copied there; the `QuantReport` is filled as each piece is
        written."""
        pieces: list[Piece] = []
        writers: list[tuple[int, Writer]] = []
        for name, tensor in group:
            if not self._quantized(name, tensor):
                pieces.append(Piece(name, tensor.dtype, tuple(tensor.shape), {}, tensor))
                writers.append((1, self._as_is_writer(name, tensor, tensor, last=True)))
                continue
            block = block_of(self.cfg, tensor.shape)
            scales = scale_shape(tensor.shape, block)
            dtype = torch.float8_e4m3fn if self.cfg.method == QuantMethod.FP8 else torch.int8
            pieces += [
                Piece(name, dtype, tuple(tensor.shape), {"block": list(block), "scale": scale_name(name)}),
                Piece(scale_name(name), torch.float32, scales, {"scale_of": name}),
            ]
            writers.append((2, self._quantized_writer(name, tensor, tensor, last=True, sums=[0.0, 0.0])))

        def fill(views: Sequence[Tensor | None]) -> None:
            at = 0
            for count, write in writers:
                write(views[at : at + count])
                at += count

        return LazyGroup(pieces, fill)

    def lazy_groups(
        self, group: Sequence[tuple[str, Tensor]], max_bytes: int | None = None
    ) -> Iterator[LazyGroup]:
        """`lazy_group` of ``group``, or, when what travels for it is larger than ``max_bytes`` (a
        bucket's capacity), each of its tensors in row chunks of at most ``max_bytes`` (whole
        blocks of rows for a quantized one: each chunk's bytes are those of the whole tensor's
        rows), so no bucket, and no sender buffer, grows past ``max_bytes`` for a large weight. A
        chunk travels under its tensor's name with ``meta["rows"] = [start, stop]`` and
        ``meta["shape"]`` (the whole tensor's); the receiver puts the chunks back together
        (`Rejoin`). The `QuantReport` gets each tensor once, when its last chunk is written."""
        group = list(group)
        if max_bytes is None or sum(self._wire_nbytes(name, tensor) for name, tensor in group) <= max_bytes:
            yield self.lazy_group(group)
            return
        for name, tensor in group:
            yield from self._row_chunks(name, tensor, max_bytes)

    def _quantized(self, name: str, tensor: Tensor) -> bool:
        return self.active and should_quantize(name, tensor, self.cfg, self.num_layers)

    def _wire_nbytes(self, name: str, tensor: Tensor) -> int:
        """Bytes that travel for ``tensor``: itself, or its 8-bit data and fp32 scales."""
        if not self._quantized(name, tensor):
            return tensor.numel() * tensor.element_size()
        return tensor.numel() + 4 * math.prod(scale_shape(tensor.shape, block_of(self.cfg, tensor.shape)))

    def _row_chunks(self, name: str, tensor: Tensor, max_bytes: int) -> Iterator[LazyGroup]:
        """``tensor`` in chunks of whole rows (whole blocks of rows when quantized) of at most
        ``max_bytes`` each (at least one row or block of rows); one group when it fits."""
        rows = tensor.shape[0] if tensor.dim() else 1
        quantized = self._quantized(name, tensor)
        if quantized:  # 2-D: a block of rows carries its 8-bit data and a row of fp32 scales
            block = block_of(self.cfg, tensor.shape)
            per_step = block[0] * tensor.shape[1] + 4 * scale_shape(tensor.shape, block)[1]
        else:
            block = (1, 1)
            per_step = tensor[:1].numel() * tensor.element_size() if tensor.dim() else tensor.nbytes
        step = max(1, max_bytes // max(per_step, 1)) * block[0]
        if step >= rows:
            yield self.lazy_group([(name, tensor)])
            return
        starts = range(0, rows, step)
        sums = [0.0, 0.0]  # Σ error², Σ original² of the chunks written so far (quantized)
        for chunk, start in enumerate(starts):
            stop, last = min(rows, start + step), start + step >= rows
            part = tensor[start:stop]
            where = {"rows": [start, stop], "shape": list(tensor.shape), "chunk": chunk}
            if not quantized:
                piece = Piece(name, tensor.dtype, tuple(part.shape), where, part)
                yield LazyGroup([piece], self._as_is_writer(name, tensor, part, last))
                continue
            first, end = start // block[0], -(-stop // block[0])
            scales = scale_shape(tensor.shape, block)
            dtype = torch.float8_e4m3fn if self.cfg.method == QuantMethod.FP8 else torch.int8
            data_meta = {"block": list(block), "scale": scale_name(name), **where}
            scale_meta = {"scale_of": name, "rows": [first, end], "shape": list(scales), "chunk": chunk}
            pieces = [
                Piece(name, dtype, tuple(part.shape), data_meta),
                Piece(scale_name(name), torch.float32, (end - first, scales[1]), scale_meta),
            ]
            yield LazyGroup(pieces, self._quantized_writer(name, tensor, part, last, sums))

    def _as_is_writer(self, name: str, tensor: Tensor, part: Tensor, last: bool) -> Writer:
        """Writes ``part`` (rows of ``tensor``, or all of it) into its view, unless it travels where
        it lies (no view); ``tensor`` counts as sent as it is once ``last`` is written."""

        def fill(views: Sequence[Tensor | None]) -> None:
            _copy_unless_sent_in_place(views[0], part)
            if last and self.active:
                self.report.add(name, tensor, None, 16)

        return fill

    def _quantized_writer(
        self, name: str, tensor: Tensor, part: Tensor, last: bool, sums: list[float]
    ) -> Writer:
        """Quantizes ``part`` (rows of ``tensor``, or all of it) into its data and scale views,
        adding its error to ``sums`` (shared by the chunks of ``tensor``); ``tensor`` goes into the
        `QuantReport` with the whole error once ``last`` is written."""

        def fill(views: Sequence[Tensor | None]) -> None:
            err, ref = quantize_into(part, self.cfg, *views)
            sums[0] += err
            sums[1] += ref
            if last:
                self.report.add_quantized(name, tensor, sums[0], sums[1], bits=8)

        return fill


class Rejoin:
    """The receiver's side of row chunks (`WireEncoder.lazy_groups`): each chunked tensor is put
    back together over the buckets of one sync, in the tensor the receiver gives for it (its
    weight, `decode`'s ``into``) or in a new one, and handed on once its last row has landed. One
    per receiver, kept from `begin` to `finish` of a sync."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Tensor, list[tuple[int, int]]]] = {}
        """name -> (the whole tensor being filled, the row ranges landed so far)."""
        self._whole: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()
        """name -> the whole tensor handed on (memory of the receiver, not of a bucket; not kept
        alive here)."""

    def target(self, name: str, chunk: Tensor, meta: dict, into: Tensor | None, dtype: torch.dtype) -> Tensor:
        """Where chunk ``meta["rows"]`` of ``name`` is written: the rows of its whole tensor
        (``into``, or one made here of ``dtype`` on ``chunk``'s device at the first chunk)."""
        shape, (start, stop) = tuple(meta["shape"]), meta["rows"]
        if not 0 <= start < stop <= shape[0] or tuple(chunk.shape) != (stop - start, *shape[1:]):
            raise ValueError(
                f"weight {name!r} arrived as rows {start}:{stop} of shape {tuple(chunk.shape)}, which are "
                f"not rows of its whole shape {shape}"
            )
        if name not in self._open:
            if into is not None and tuple(into.shape) != shape:
                raise ValueError(
                    f"weight {name!r} arrives in chunks of a {shape} tensor, but the tensor it loads into "
                    f"has shape {tuple(into.shape)}"
                )
            whole = into if into is not None else torch.empty(shape, dtype=dtype, device=chunk.device)
            self._open[name] = (whole, [])
        whole, landed = self._open[name]
        if any(start < b and a < stop for a, b in landed):
            raise ValueError(
                f"weight {name!r}: rows {start}:{stop} arrived twice in one sync (landed: {landed})"
            )
        landed.append((start, stop))
        return whole[start:stop]

    def complete(self, name: str) -> Tensor | None:
        """The whole tensor once every row of ``name`` has landed (then forgotten here), else None."""
        whole, landed = self._open[name]
        if sum(b - a for a, b in landed) < whole.shape[0]:
            return None
        del self._open[name]
        self._whole[name] = whole
        return whole

    def owns(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the whole tensor this put together for ``name`` this sync."""
        return self._whole.get(name) is tensor

    def finish(self) -> None:
        """Raise if a chunked tensor is still missing rows at the end of a sync (and forget it)."""
        if self._open:
            name, (whole, landed) = next(iter(self._open.items()))
            count = len(self._open)
            self._open.clear()
            raise ValueError(
                f"weight sync incomplete: {count} tensor(s) arrived in part, e.g. {name!r}: rows "
                f"{sorted(landed)} of {whole.shape[0]}"
            )


def decode(
    items: Iterable[tuple[str, Tensor, dict]],
    into: Callable[[str], Tensor | None] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    rejoin: Rejoin | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """What arrived -> ``(HF name, values)``: quantized weights dequantized with their scales
    (which must travel in the same bucket, as the encoder sends them). ``into(name)`` may give the
    tensor a quantized weight's values are to end up in (the engine's weight, or a view of it): they
    are decoded straight into it and it is what is yielded. Otherwise they are decoded into a new
    tensor of ``dtypes[name]`` (the dtype of the weight they will be loaded into), float32 where
    ``dtypes`` has no entry. A tensor that travels in row chunks is written chunk by chunk into
    ``into(name)`` (or a new tensor) through ``rejoin`` and yielded with its last chunk."""
    items = list(items)
    scales = {
        (meta["scale_of"], meta.get("chunk")): tensor for _, tensor, meta in items if "scale_of" in meta
    }
    for name, tensor, meta in items:
        if "scale_of" in meta:
            continue
        if "rows" in meta:
            whole = _rejoined(name, tensor, meta, scales, into, dtypes, rejoin)
            if whole is not None:
                yield name, whole
            continue
        if "block" not in meta:
            yield name, tensor
            continue
        if (name, None) not in scales:
            raise ValueError(f"weight {name!r} arrived quantized without its scales {meta['scale']!r}")
        target = into(name) if into is not None else None
        if target is not None and tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} arrived with shape {tuple(tensor.shape)}, but the tensor it loads into "
                f"has shape {tuple(target.shape)}"
            )
        dtype = (dtypes or {}).get(name, torch.float32)
        yield name, dequantize(tensor, scales[name, None], tuple(meta["block"]), out=target, dtype=dtype)


def _rejoined(
    name: str,
    chunk: Tensor,
    meta: dict,
    scales: Mapping[tuple[str, int | None], Tensor],
    into: Callable[[str], Tensor | None] | None,
    dtypes: Mapping[str, torch.dtype] | None,
    rejoin: Rejoin | None,
) -> Tensor | None:
    """Write a row chunk into its whole tensor (decoded when quantized); the whole tensor once
    complete."""
    if rejoin is None:
        raise ValueError(f"weight {name!r} arrived in row chunks, but this receiver keeps no Rejoin state")
    quantized = "block" in meta
    if quantized and (name, meta.get("chunk")) not in scales:
        raise ValueError(
            f"weight {name!r} (rows {meta['rows']}) arrived quantized without its scales {meta['scale']!r}"
        )
    dtype = (dtypes or {}).get(name, torch.float32 if quantized else chunk.dtype)
    rows = rejoin.target(name, chunk, meta, into(name) if into is not None else None, dtype)
    if quantized:
        dequantize(chunk, scales[name, meta.get("chunk")], tuple(meta["block"]), out=rows)
    else:  # on the receiver's threads, as an engine copies a weight in (`hf_weights.load_hf_subset`)
        copy_into(rows, chunk, threads=torch.get_num_threads())
    return rejoin.complete(name)
