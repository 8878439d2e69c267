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
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.config.modes import Granularity, QuantMethod
from moe_rl.config.schema import QuantConfig
from moe_rl.device import copy_into
from moe_rl.quant import fused
from moe_rl.quant.recipes import FP8_E4M3_MAX, QuantReport, should_quantize

INT8_MAX = 127.0
WIRE_METHODS = ("fp8", "int8")
"""Recipes whose quantized bytes travel; the others send the tensor itself."""


def scale_name(weight_name: str) -> str:
    """Name the scales of ``weight_name`` travel under (vLLM's block-FP8 checkpoint name)."""
    return weight_name.removesuffix(".weight") + ".weight_scale_inv"


def _block(cfg: QuantConfig, shape: torch.Size) -> tuple[int, int]:
    if cfg.granularity == Granularity.BLOCK:
        return cfg.block_size, cfg.block_size
    if cfg.granularity == Granularity.CHANNEL:
        return 1, shape[1]
    return shape[0], shape[1]


def _block_amax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """``max |x|`` per ``block`` (partial blocks at the edges count their own elements)."""
    rows, cols = x.shape
    bo, bi = block
    pr, pc = -rows % bo, -cols % bi
    padded = torch.nn.functional.pad(x.abs(), (0, pc, 0, pr))
    return padded.view((rows + pr) // bo, bo, (cols + pc) // bi, bi).amax(dim=(1, 3))


def _scale_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _expand(scale: Tensor, block: tuple[int, int], shape: torch.Size) -> Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def quantize_fp8(weight: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(e4m3 data, fp32 scales, block)`` of a 2-D weight under an fp8 recipe."""
    block = _block(cfg, weight.shape)
    if cfg.granularity == Granularity.BLOCK:
        from moe_rl.quant.fp8_block import quantize_fp8_block

        data, scale = quantize_fp8_block(weight, cfg.block_size)
        return data, scale, block
    x = weight.float()
    scale = _block_amax(x, block) / FP8_E4M3_MAX
    full = _expand(scale, block, x.shape)
    data = torch.where(full > 0, x / full, torch.zeros_like(x)).to(torch.float8_e4m3fn)
    return data, scale, block


def quantize_int8(weight: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(int8 data, fp32 scales, block)`` of a 2-D weight: symmetric, ±127, per row or tensor."""
    block = (
        (1, weight.shape[1]) if cfg.granularity == Granularity.CHANNEL else (weight.shape[0], weight.shape[1])
    )
    x = weight.float()
    scale = _block_amax(x, block) / INT8_MAX
    full = _expand(scale, block, x.shape)
    q = torch.where(full > 0, x / full, torch.zeros_like(x)).round().clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale, block


def dequantize(
    data: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    out: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The values a quantized engine holds: ``data · scale`` blockwise, computed in float32 (the
    scales broadcast over their blocks, not expanded) and written into ``out`` (a floating tensor of
    ``data``'s shape and device, e.g. the engine's weight: the float32 values cast to its dtype) or
    into a new tensor of ``dtype`` (the same values as a float32 result cast to it).

    On CPU a large e4m3 weight of whole blocks is decoded by one fused kernel (`fused.decode`);
    otherwise this runs over `DECODE_CHUNK_ELEMENTS` at a time through a small scratch that stays in
    the caches, so the float32 values of a whole weight never exist and ``out`` is written once."""
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    elif tuple(out.shape) != tuple(data.shape) or not out.is_floating_point() or out.device != data.device:
        raise ValueError(
            f"cannot decode a {tuple(data.shape)} weight on {data.device} into a {out.dtype} "
            f"{tuple(out.shape)} tensor on {out.device}"
        )
    scale = scale.float()
    if data.numel() == 0:
        return out
    rows, cols = data.shape
    bo, bi = block
    row_block = torch.arange(rows, device=data.device) // bo
    if data.device.type != "cpu":  # one pass of whole-tensor ops on an accelerator
        out.copy_(_scaled_rows(data.float(), scale.index_select(0, row_block), bi))
        return out
    if (
        data.dtype == torch.float8_e4m3fn
        and fused.usable(data.shape, block, data.device)
        and fused.decode(data, scale, block, out)
    ):
        return out
    shifted = scale * E4M3_OFFSET
    bits = _e4m3_bits_decodable(data, shifted)
    factor = shifted if bits else scale
    step = max(1, DECODE_CHUNK_ELEMENTS // cols)
    in_place = out.dtype == torch.float32 and out.is_contiguous()
    scratch = None if in_place else _scratch(min(rows, step) * cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        values = out[start:stop] if in_place else scratch[: (stop - start) * cols].view(stop - start, cols)
        if bits:
            as_int = values.view(torch.int32)
            as_int.copy_(data[start:stop].view(torch.int8))  # sign-extended: the sign lands in bits 8..31
            as_int.bitwise_left_shift_(20).bitwise_and_(_F32_SIGN_AND_E4M3_BITS)
        else:
            values.copy_(data[start:stop])  # torch's conversion
        _scaled_rows(values, factor.index_select(0, row_block[start:stop]), bi)
        if not in_place:
            out[start:stop].copy_(values)
    return out


DECODE_CHUNK_ELEMENTS = 1 << 20
"""Elements a CPU decode works on at a time (4 MB of float32 scratch: cache-resident, so its
integer and scaling passes run at cache speed and only the result goes to memory)."""
_SCRATCH = threading.local()


def _scratch(elements: int) -> Tensor:
    """This thread's float32 decode scratch, at least ``elements`` long (kept from call to call)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < elements:
        buf = _SCRATCH.buf = torch.empty(elements, dtype=torch.float32)
    return buf


def _scaled_rows(values: Tensor, scales: Tensor, bi: int) -> Tensor:
    """``values`` (rows, cols) times ``scales`` (rows, column blocks), each over its ``bi`` columns
    (the last block may be partial), in place."""
    rows, cols = values.shape
    full = cols // bi
    if full:
        values[:, : full * bi].view(rows, full, bi).mul_(scales[:, :full, None])
    if full * bi < cols:
        values[:, full * bi :].mul_(scales[:, full:])
    return values


E4M3_OFFSET = 2.0**120
"""An e4m3 byte's sign, exponent and mantissa bits placed where float32 keeps them give its value
times ``2**-120`` (the exponent biases differ by 127 - 7), subnormals and zero included."""
_F32_SIGN_AND_E4M3_BITS = -(1 << 31) | 0x07F0_0000  # (int32) sign bit, then 4 + 3 bits from bit 20


def _e4m3_bits_decodable(data: Tensor, shifted_scale: Tensor) -> bool:
    """Whether ``data · scale`` may be computed from e4m3 bits placed into float32 bits (the power of
    two they are off by, `E4M3_OFFSET`, moved into the scale: ``shifted_scale`` = ``scale ·
    E4M3_OFFSET``, exact, only the exponent changes).
    torch converts e4m3 to float one element at a time on CPU (~0.15 G elements/s here); the bits
    take vectorized integer passes. Not when the moved offset overflows (a scale >= 2**8, or NaN)
    or a byte is e4m3's NaN (0x7F, 0xFF), which the bits would read as 480."""
    if data.dtype != torch.float8_e4m3fn:
        return False
    if not bool(torch.isfinite(shifted_scale).all()):
        return False
    return int(data.view(torch.int8).max()) != 0x7F and int(data.view(torch.uint8).max()) != 0xFF


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

    def encode(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor, dict]]:
        """``[(name, tensor, meta)]`` that travel for one HF tensor."""
        if not self.active or not should_quantize(name, tensor, self.cfg, self.num_layers):
            if self.active:
                self.report.add(name, tensor, None, 16)
            return [(name, tensor, {})]
        block = _block(self.cfg, tensor.shape)
        if self._fused(tensor, block):  # quantized and measured in one fused pass
            data = torch.empty(tensor.shape, dtype=torch.float8_e4m3fn)
            scale = torch.empty(_scale_shape(tensor.shape, block), dtype=torch.float32)
            self._quantize_into(name, tensor, data, scale)
        else:
            quantize = quantize_fp8 if self.cfg.method == QuantMethod.FP8 else quantize_int8
            data, scale, block = quantize(tensor, self.cfg)
            self.report.add_quantized(name, tensor, *_errors(tensor, data, scale, block), bits=8)
        meta = {"block": list(block), "scale": scale_name(name)}
        return [(name, data, meta), (scale_name(name), scale, {"scale_of": name})]

    def encode_group(self, group: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor, dict]]:
        return [item for name, tensor in group for item in self.encode(name, tensor)]

    def lazy_group(self, group: Iterable[tuple[str, Tensor]]) -> LazyGroup:
        """`encode_group`, written into the bucket by the packer: quantized data and scales go
        straight into their place (block FP8 on CPU without any full-size temporary), other tensors
        are copied there; the `QuantReport` is filled as each piece is written."""
        pieces: list[Piece] = []
        writers: list[tuple[int, Writer]] = []
        for name, tensor in group:
            if not self._quantized(name, tensor):
                pieces.append(Piece(name, tensor.dtype, tuple(tensor.shape), {}, tensor))
                writers.append((1, self._as_is_writer(name, tensor, tensor, last=True)))
                continue
            block = _block(self.cfg, tensor.shape)
            scales = _scale_shape(tensor.shape, block)
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
        return tensor.numel() + 4 * math.prod(_scale_shape(tensor.shape, _block(self.cfg, tensor.shape)))

    def _row_chunks(self, name: str, tensor: Tensor, max_bytes: int) -> Iterator[LazyGroup]:
        """``tensor`` in chunks of whole rows (whole blocks of rows when quantized) of at most
        ``max_bytes`` each (at least one row or block of rows); one group when it fits."""
        rows = tensor.shape[0] if tensor.dim() else 1
        quantized = self._quantized(name, tensor)
        if quantized:  # 2-D: a block of rows carries its 8-bit data and a row of fp32 scales
            block = _block(self.cfg, tensor.shape)
            per_step = block[0] * tensor.shape[1] + 4 * _scale_shape(tensor.shape, block)[1]
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
            scales = _scale_shape(tensor.shape, block)
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
            err, ref = self._quantize_sums(part, *views)
            sums[0] += err
            sums[1] += ref
            if last:
                self.report.add_quantized(name, tensor, sums[0], sums[1], bits=8)

        return fill

    def _fused(self, tensor: Tensor, block: tuple[int, int]) -> bool:
        """Whether ``tensor`` is block-FP8 encoded by the fused CPU kernel (`fused.encode_fp8_block`)."""
        return (
            self.cfg.method == QuantMethod.FP8
            and self.cfg.granularity == Granularity.BLOCK
            and fused.usable(tensor.shape, block, tensor.device)
        )

    def _quantize_into(self, name: str, tensor: Tensor, data: Tensor, scale: Tensor) -> None:
        self.report.add_quantized(name, tensor, *self._quantize_sums(tensor, data, scale), bits=8)

    def _quantize_sums(self, tensor: Tensor, data: Tensor, scale: Tensor) -> tuple[float, float]:
        """Quantize ``tensor`` into ``data`` and ``scale``; ``(Σ error², Σ original²)``."""
        block = _block(self.cfg, tensor.shape)
        if self._fused(tensor, block) and tensor.device == data.device:
            sums = fused.encode_fp8_block(tensor, self.cfg.block_size, data, scale)
            if sums is not None:
                return sums
        if (
            self.cfg.method == QuantMethod.FP8
            and self.cfg.granularity == Granularity.BLOCK
            and tensor.device == data.device
        ):
            from moe_rl.quant.fp8_block import torch_fp8_block

            torch_fp8_block(tensor, self.cfg.block_size, out=(data, scale))  # in place, row blocks at a time
            sent_data, sent_scale = data, scale
        else:  # computed on the tensor's device (the Triton kernel on CUDA), then copied in
            quantize = quantize_fp8 if self.cfg.method == QuantMethod.FP8 else quantize_int8
            sent_data, sent_scale, block = quantize(tensor, self.cfg)
            data.copy_(sent_data)
            scale.copy_(sent_scale)
        return _errors(tensor, sent_data, sent_scale, block)


ERROR_ROWS = 128
"""Rows per chunk when the sender measures the quantization error (bounded temporaries)."""


def _errors(original: Tensor, data: Tensor, scale: Tensor, block: tuple[int, int]) -> tuple[float, float]:
    """``(Σ (dequantized − original)², Σ original²)``, chunk by chunk of whole row blocks."""
    step = max(block[0], ERROR_ROWS // block[0] * block[0])
    err = ref = 0.0
    for start in range(0, original.shape[0], step):
        rows = slice(start, start + step)
        first = start // block[0]
        part = dequantize(data[rows], scale[first : first + -(-data[rows].shape[0] // block[0])], block)
        x = original[rows].float().reshape(-1)  # (the weight itself when it is float32: read only)
        ref += float(torch.dot(x, x))
        diff = part.reshape(-1).sub_(x)
        err += float(torch.dot(diff, diff))
    return err, ref


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
