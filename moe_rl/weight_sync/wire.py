"""The rollout quantization recipe on the wire: what travels for each weight (`WireEncoder`) and what it
decodes to (`decode`, the values a fake-quantizing engine computes with). A recipe of ``WIRE_METHODS`` sends
8-bit data and fp32 scales per block (`moe_rl.quant.codec`; ``fp8`` in vLLM's ``weight_scale_inv`` layout);
other recipes, weights it leaves alone and syncs to self-quantizing engines send the tensor itself.
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
    """The tensor itself, when it travels as it is (then a packer may carry it as it lies)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class LazyGroup:
    """A group's pieces and how to write them: ``fill(views)`` computes each piece straight into its view in
    the bucket (None: the packer sends it where it lies)."""

    pieces: list[Piece]
    fill: Callable[[Sequence[Tensor | None]], None]

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)


class WireEncoder:
    """The sender's side: HF-named tensors -> what travels, with the sync's `QuantReport`."""

    def __init__(self, cfg: QuantConfig, num_layers: int, quantized_wire: bool = True):
        self.cfg, self.num_layers = cfg, num_layers
        self.active = quantized_wire and cfg.method in WIRE_METHODS
        self.report = QuantReport(cfg.name)

    def lazy_group(self, group: Iterable[tuple[str, Tensor]]) -> LazyGroup:
        """What travels for ``group``, written into the bucket by the packer: a quantized weight as its data
        and scales (``<name>_scale_inv``), others as they are."""
        made = [self._pieces(name, tensor) for name, tensor in group]

        def fill(views: Sequence[Tensor | None]) -> None:
            at = 0
            for pieces, write in made:
                write(views[at : at + len(pieces)])
                at += len(pieces)

        return LazyGroup([piece for pieces, _ in made for piece in pieces], fill)

    def lazy_groups(
        self, group: Sequence[tuple[str, Tensor]], max_bytes: int | None = None
    ) -> Iterator[LazyGroup]:
        """`lazy_group` of ``group``, or, when what travels for it is larger than ``max_bytes``, each tensor
        in row chunks of at most that (whole blocks of rows when quantized) under its name, with
        ``meta["rows"] = [start, stop]``, ``meta["shape"]`` (the whole's) and ``meta["chunk"]``."""
        group = list(group)
        whole = self.lazy_group(group)  # nothing is computed before the packer fills it
        if max_bytes is None or whole.nbytes <= max_bytes:
            yield whole
            return
        for name, tensor in group:
            yield from self._row_chunks(name, tensor, max_bytes)

    def _quantized(self, name: str, tensor: Tensor) -> bool:
        return self.active and should_quantize(name, tensor, self.cfg, self.num_layers)

    def _row_chunks(self, name: str, tensor: Tensor, max_bytes: int) -> Iterator[LazyGroup]:
        """``tensor`` in row chunks (blocks of rows when quantized) of at most ``max_bytes``, at least one."""
        rows = tensor.shape[0] if tensor.dim() else 1
        if self._quantized(name, tensor):  # 2-D: a block of rows carries its 8-bit data and a row of scales
            block = block_of(self.cfg, tensor.shape)
            per_step = block[0] * tensor.shape[1] + 4 * scale_shape(tensor.shape, block)[1]
        else:
            block = (1, 1)
            per_step = tensor[:1].numel() * tensor.element_size() if tensor.dim() else tensor.nbytes
        step = max(1, max_bytes // max(per_step, 1)) * block[0]
        if step >= rows:
            yield self.lazy_group([(name, tensor)])
            return
        sums = [0.0, 0.0]  # Σ error², Σ original² of the chunks written so far (quantized)
        for chunk, start in enumerate(range(0, rows, step)):
            yield LazyGroup(*self._pieces(name, tensor, (start, min(rows, start + step), chunk), sums))

    def _pieces(
        self, name: str, tensor: Tensor, rows: tuple[int, int, int] | None = None, sums: list | None = None
    ) -> tuple[list[Piece], Callable[[Sequence[Tensor | None]], None]]:
        """The pieces that travel for ``tensor`` (with ``rows``: start, stop, chunk of it) and their writer,
        which reports ``tensor`` with its last chunk (the error summed over its chunks in ``sums``)."""
        part, where, last = tensor, {}, True
        if rows is not None:
            start, stop, chunk = rows
            part, last = tensor[start:stop], stop >= tensor.shape[0]
            where = {"rows": [start, stop], "shape": list(tensor.shape), "chunk": chunk}
        if not self._quantized(name, tensor):

            def copy(views: Sequence[Tensor | None]) -> None:
                if views[0] is not None:  # else it travels where it lies
                    copy_into(views[0], part)
                if last and self.active:
                    self.report.add(name, tensor, None, 16)

            return [Piece(name, tensor.dtype, tuple(part.shape), where, part)], copy
        block = block_of(self.cfg, tensor.shape)
        scales = scale_shape(tensor.shape, block)
        scale_meta, scale_rows = {"scale_of": name}, scales
        if rows is not None:
            first, end = start // block[0], -(-stop // block[0])
            scale_meta |= {"rows": [first, end], "shape": list(scales), "chunk": chunk}
            scale_rows = (end - first, scales[1])
        dtype = torch.float8_e4m3fn if self.cfg.method == QuantMethod.FP8 else torch.int8
        sums = [0.0, 0.0] if sums is None else sums

        def quantize(views: Sequence[Tensor | None]) -> None:
            err, ref = quantize_into(part, self.cfg, *views)
            sums[0] += err
            sums[1] += ref
            if last:
                self.report.add_quantized(name, tensor, sums[0], sums[1], bits=8)

        return [
            Piece(name, dtype, tuple(part.shape), {"block": list(block), "scale": scale_name(name), **where}),
            Piece(scale_name(name), torch.float32, scale_rows, scale_meta),
        ], quantize


class Rejoin:
    """The receiver's side of row chunks, one per receiver and sync: each tensor put back together in the
    receiver's tensor (`decode`'s ``into``) or a new one, and handed on once whole."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Tensor, list[tuple[int, int]]]] = {}
        """name -> (the whole tensor being filled, the row ranges landed so far)."""
        self._whole: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()
        """name -> the whole tensor handed on (the receiver's memory, not a bucket's)."""

    def target(self, name: str, chunk: Tensor, meta: dict, into: Tensor | None, dtype: torch.dtype) -> Tensor:
        """Where rows ``meta["rows"]`` of ``name`` go: in its whole tensor (``into``, or one made here)."""
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
    """What arrived -> ``(HF name, values)``, quantized weights dequantized with their scales (from the same
    bucket) into ``into(name)`` when it gives a tensor (then yielded), else into a new one of
    ``dtypes.get(name, float32)``. A tensor in row chunks is put together by ``rejoin`` and yielded whole."""
    items = list(items)
    scales = {
        (meta["scale_of"], meta.get("chunk")): tensor for _, tensor, meta in items if "scale_of" in meta
    }
    for name, tensor, meta in items:
        if "scale_of" in meta:
            continue
        chunked, quantized = "rows" in meta, "block" in meta
        if not (chunked or quantized):
            yield name, tensor
            continue
        if chunked and rejoin is None:
            raise ValueError(
                f"weight {name!r} arrived in row chunks, but this receiver keeps no Rejoin state"
            )
        scale = scales.get((name, meta.get("chunk")))
        if quantized and scale is None:
            where = f" (rows {meta['rows']})" if chunked else ""
            raise ValueError(f"weight {name!r}{where} arrived quantized without its scales {meta['scale']!r}")
        target = into(name) if into is not None else None
        if chunked:
            dtype = (dtypes or {}).get(name, torch.float32 if quantized else tensor.dtype)
            rows = rejoin.target(name, tensor, meta, target, dtype)
            if quantized:
                dequantize(tensor, scale, tuple(meta["block"]), out=rows)
            else:  # on the receiver's threads, as an engine copies a weight in (`hf_weights.load_hf_subset`)
                copy_into(rows, tensor, threads=torch.get_num_threads())
            whole = rejoin.complete(name)
            if whole is not None:
                yield name, whole
            continue
        if target is not None and tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} arrived with shape {tuple(tensor.shape)}, but the tensor it loads into "
                f"has shape {tuple(target.shape)}"
            )
        dtype = (dtypes or {}).get(name, torch.float32)
        yield name, dequantize(tensor, scale, tuple(meta["block"]), out=target, dtype=dtype)
