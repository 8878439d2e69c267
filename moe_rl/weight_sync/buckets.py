"""Buckets: named tensors packed into one flat byte buffer, the unit that is published to engines.

A bucket holds whole groups (all the HF pieces of one Megatron tensor travel together, so a
receiver can fuse them on arrival) up to about ``capacity`` bytes; a group larger than that gets a
bucket of its own. The runtime's sender never makes one: it sends a weight larger than a bucket in
row chunks, each a group of its own (`wire.WireEncoder.lazy_groups`). Its bytes live in one of two
places:

* a shared-memory slot of the sender (`moe_rl.weight_sync.shm`), when every receiver is on the
  sender's node: the bucket that travels is its entries and the slot's name, and receivers read the
  bytes in place;
* a NumPy ``uint8`` buffer that the packer reuses for every bucket it fills, published through Ray's
  object store (one copy into the store, read without copying by every receiver on a node). A
  contiguous CPU tensor that travels as it is is not packed: the bucket carries it as it lies
  (`Bucket.arrays`) and ``ray.put`` copies it straight into the store;
* a ``uint8`` tensor on the sender's device (a packer given ``device``), which receivers on the
  same machine map by torch's IPC handle (`moe_rl.weight_sync.ipc`; CUDA IPC on GPUs): the bucket
  that travels is its entries and the handle (`Bucket.ipc`).

Either way a sender holds at most two buckets' worth of buffers, not one per bucket. A packer given
the sender's `shm.SharedArena` (a CPU trainer's parameters in shared memory) writes nothing for a
tensor that travels as it is and lies in the arena: its entry says where it lies, and receivers read
it there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from moe_rl.device import transient_bytes
from moe_rl.weight_sync.ipc import IpcRef, open_ref
from moe_rl.weight_sync.shm import ALIGN, SharedArena, SharedSlots, SlotRef, aligned, read_slot
from moe_rl.weight_sync.wire import LazyGroup, Piece

PART_BYTES = 128 << 20
"""Default size of the parts a bucket in a shared slot travels in (`BucketPacker`): small enough
that receivers start early, large enough that a part's delivery (one call per receiver) costs little
next to reading it."""

SLACK = 64 * ALIGN
"""Room a bucket's buffer has beyond its capacity for the padding of the tensors written in it
(each starts at a multiple of `shm.ALIGN`)."""


_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8,
        torch.int16, torch.int32, torch.int64, torch.bool,
    )
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor inside a bucket's buffer."""

    name: str
    """The name it travels under (HF names; FP8 scales as ``<weight>_scale_inv``)."""
    dtype: str
    """torch dtype name, e.g. ``float8_e4m3fn``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer."""
    nbytes: int
    meta: dict = field(default_factory=dict)
    """What the wire format needs to decode it (e.g. the FP8 block shape)."""
    source: SlotRef | None = None
    """Where the tensor lies in its sender's shared arena, when it was not copied into the buffer
    (then ``offset`` is unused)."""
    array: int | None = None
    """Index of the bucket's `Bucket.arrays` entry that holds the tensor, when it was not copied into
    the buffer (then ``offset`` is unused)."""


@dataclass
class Bucket:
    """Tensors in one flat buffer, ready to publish; `tensors` gives them back as views. A bucket in
    a shared slot may travel in parts (consecutive groups of it, see `BucketPacker`): each part is a
    `Bucket` of its own (its entries, the slot's byte range), with the bucket's ``index``."""

    entries: list[Entry]
    buffer: np.ndarray | None
    """uint8: the written entries, each at an `ALIGN`-ed offset (on a receiver of a shared slot:
    mapped on first use)."""
    index: int = 0
    """Position in its sender's stream."""
    sender: int = 0
    """Trainer rank that sent it."""
    slot: SlotRef | None = None
    """The shared-memory slot holding the bytes; then only the entries and this travel."""
    part: int = 0
    """Position of this part in its bucket (0 for a bucket that travels whole)."""
    last: bool = True
    """Whether this is the bucket's last part (always, for a bucket that travels whole)."""
    arrays: list[np.ndarray | Tensor] = field(default_factory=list)
    """Tensors that travel as the sender holds them (flat ``uint8`` views, no copy): ``ray.put``
    copies each straight into the object store (pickled as NumPy arrays, which travel out of band),
    so they are copied once on the sender, not packed into the buffer first. They stay torch views
    until pickled: a NumPy view makes torch mark the parameter's storage as not resizable, which
    would keep it from leaving device memory between phases (`moe_rl.offload`)."""
    ipc: IpcRef | None = None
    """Where the bytes lie in the sender's shared device buffer; then only the entries and this
    travel (`moe_rl.weight_sync.ipc`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it carries (those read in the sender's arena included)."""
        return sum(entry.nbytes for entry in self.entries)

    @property
    def data(self) -> np.ndarray | Tensor:
        """The bucket's bytes (a receiver of a shared slot or device buffer maps it here)."""
        if self.buffer is None:
            self.buffer = open_ref(self.ipc) if self.ipc is not None else read_slot(self.slot)
        return self.buffer

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["arrays"] = [transient_bytes(a) if isinstance(a, Tensor) else a for a in self.arrays]
        if self.slot is not None or self.ipc is not None:
            state["buffer"] = None  # the bytes stay in the slot, or in the sender's device buffer
        return state

    def tensors(self) -> Iterator[tuple[Entry, Tensor]]:
        """``(entry, tensor)`` views into the buffer (read-only when the buffer is). Views of a
        shared slot or arena are valid while the receiver handles the bucket: copy what is kept longer."""
        flat = None
        for entry in self.entries:
            if entry.source is not None:
                raw = _tensor(read_slot(entry.source))
            elif entry.array is not None:
                array = self.arrays[entry.array]
                raw = array if isinstance(array, Tensor) else _tensor(array)
            else:
                flat = (
                    (self.data if isinstance(self.data, Tensor) else _tensor(self.data))
                    if flat is None
                    else flat
                )
                raw = flat[entry.offset : entry.offset + entry.nbytes]
            yield entry, raw.view(_DTYPES[entry.dtype]).reshape(entry.shape)


def _tensor(buffer: np.ndarray) -> Tensor:
    return torch.from_numpy(buffer) if buffer.flags.writeable else _readonly(buffer)


def _readonly(buffer: np.ndarray) -> Tensor:
    """A tensor over a read-only array (a published bucket): no copy; it must not be written."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(buffer)


class BucketPacker:
    """Packs groups of ``(name, tensor, meta)`` into buckets of at most ``capacity`` bytes (a group
    larger than that: a bucket of its own), in order, into buffers it keeps from sync to sync (grown
    to the largest group when one is larger than ``capacity``, never shrunk), whose pages are touched
    once. A buffer has `SLACK` bytes beyond ``capacity`` for the padding of the tensors written in it
    (`ALIGN`); a bucket whose padding would overflow them (many tiny tensors) ends early.

    * without ``slots``: ``buffers`` working buffers (default one), bucket ``i`` in buffer
      ``i % buffers``. A yielded bucket's buffer is valid until the packer comes back to it: with
      one, until the next bucket is requested (publish it, ``ray.put`` copies it, or `detach` it
      first); with two, the sender may still be sending bucket ``i`` while bucket ``i + 1`` is packed;
    * with ``slots`` (`shm.SharedSlots`): bucket ``i`` goes to slot ``i % num_slots``, valid until the
      packer comes back to that slot; the caller makes sure receivers are done with it by then.
      Such a bucket is yielded in parts of about ``part_bytes`` (whole groups; the last part is
      marked ``last``), each as soon as it is written, so receivers read the start of a bucket while
      the sender still writes the rest of it (a pipeline of parts, not of whole buckets). A part
      adds no memory: it is a byte range of the bucket's slot;
    * with ``device``: like the working buffers, each a ``uint8`` tensor on that device (every piece
      is written into it, nothing is carried as it lies), for a transport that hands the buffer by
      IPC handle.

    With ``arena`` (`shm.SharedArena`, only together with ``slots``) a piece that travels as it is
    (`wire.Piece.source`) and lies in the arena is not written: its entry points there. It counts
    towards the bucket's and the part's size (what receivers read) but takes no room in the slot.
    Without ``slots`` such a piece, when it is a contiguous CPU tensor, is not written either: the
    bucket carries it as it lies (`Bucket.arrays`), valid as long as the tensor is unchanged.
    """

    def __init__(
        self,
        capacity: int,
        sender: int = 0,
        slots: SharedSlots | None = None,
        part_bytes: int | None = None,
        arena: SharedArena | None = None,
        buffers: int = 1,
        device: torch.device | str | None = None,
    ):
        if capacity <= 0:
            raise ValueError(f"bucket capacity={capacity} bytes must be > 0")
        if arena is not None and slots is None:
            raise ValueError("a packer reads tensors in a shared arena only with shared slots")
        if device is not None and slots is not None:
            raise ValueError("a packer writes into shared slots or into device buffers, not both")
        self.capacity, self.sender, self.slots, self.arena = capacity, sender, slots, arena
        self.device = None if device is None else torch.device(device)
        self.part_bytes = None if slots is None else min(capacity, part_bytes or PART_BYTES)
        empty = (
            (lambda: np.empty(0, dtype=np.uint8))
            if device is None
            else (lambda: torch.empty(0, dtype=torch.uint8, device=self.device))
        )
        self.buffers: list[np.ndarray | Tensor] = [empty() for _ in range(max(1, buffers))]

    def _target(self, index: int, size: int) -> tuple[np.ndarray, str | None]:
        """Where bucket ``index`` is written, for a bucket of at least ``size`` bytes."""
        size = max(size, self.capacity + SLACK)
        if self.slots is not None:
            return self.slots.buffer(index, size)
        i = index % len(self.buffers)
        if size > self.buffers[i].nbytes:
            if self.device is None:
                self.buffers[i] = np.empty(size, dtype=np.uint8)
            else:
                self.buffers[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[i], None

    def pack(self, groups: Iterator[LazyGroup | Sequence[tuple[str, Tensor, dict]]]) -> Iterator[Bucket]:
        """Buckets (or parts of buckets, see the class) of ``groups``: lists of ``(name, tensor,
        meta)`` (copied in) or `wire.LazyGroup` (written in place, e.g. quantized straight into the
        bucket). A part is yielded when the next group is known to go into the same bucket, so the
        last part of a bucket is never empty."""
        entries: list[Entry] = []
        used = start = count = part = 0  # bytes written into this bucket's buffer; where this part's begin
        size = part_size = 0  # bytes of this bucket and of this part, those not written included
        arrays: list[np.ndarray | Tensor] = []  # this bucket's tensors carried as they lie (no slots)
        target, path = None, None
        for group in groups:
            lazy = group if isinstance(group, LazyGroup) else LazyGroup.of(group)
            sources = [self._unwritten(piece) for piece in lazy.pieces]
            written = sum(aligned(p.nbytes) for p, at in zip(lazy.pieces, sources, strict=True) if at is None)
            if entries and (size + lazy.nbytes > self.capacity or used + written > target.nbytes):
                yield self._bucket(entries, target, path, start, used, count, part, True, arrays)
                entries, used, start, size, part_size, count, part = [], 0, 0, 0, 0, count + 1, 0
                target, arrays = None, []
            elif entries and self.part_bytes is not None and part_size >= self.part_bytes:
                yield self._bucket(entries, target, path, start, used, count, part, False, arrays)
                entries, start, part_size, part = [], used, 0, part + 1
            if target is None or used + written > target.nbytes:  # a new bucket, or an oversized group
                target, path = self._target(count, written)
            views: list[Tensor | None] = []
            for piece, at in zip(lazy.pieces, sources, strict=True):
                if isinstance(at, SlotRef):
                    entries.append(_entry(piece, 0, source=at))
                elif at is not None:
                    entries.append(_entry(piece, 0, array=len(arrays)))
                    arrays.append(at.detach().reshape(-1).view(torch.uint8))
                if at is not None:
                    views.append(None)
                    continue
                entries.append(_entry(piece, used - start))
                views.append(_view(target, _entry(piece, used), piece.dtype))
                target[used + piece.nbytes : used + aligned(piece.nbytes)] = 0  # no stray bytes travel
                used += aligned(piece.nbytes)
            size += lazy.nbytes
            part_size += lazy.nbytes
            lazy.fill(views)
        if entries:
            yield self._bucket(entries, target, path, start, used, count, part, True, arrays)

    def _unwritten(self, piece: Piece) -> SlotRef | Tensor | None:
        """How ``piece`` travels without being written: where it lies in the arena (with slots), or
        the tensor itself (without slots: a contiguous CPU tensor); None: it is written."""
        source = piece.source
        if source is None or source.dtype != piece.dtype or source.numel() == 0:
            return None
        if self.slots is not None:
            return self.arena.locate(source) if self.arena is not None else None
        if self.device is None and source.device.type == "cpu" and source.is_contiguous():
            return source
        return None

    def _bucket(
        self,
        entries: list[Entry],
        target: np.ndarray,
        path: str | None,
        start: int,
        end: int,
        index: int,
        part: int,
        last: bool,
        arrays: list[np.ndarray | Tensor],
    ) -> Bucket:
        """Bytes ``start:end`` of ``target``, whose entries' offsets count from ``start``."""
        slot = SlotRef(path, end - start, start) if path is not None else None
        return Bucket(entries, target[start:end], index, self.sender, slot, part, last, arrays)


def _entry(piece: Piece, offset: int, source: SlotRef | None = None, array: int | None = None) -> Entry:
    dtype = str(piece.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"weight {piece.name!r} has dtype {piece.dtype}, which no bucket carries")
    return Entry(piece.name, dtype, piece.shape, offset, piece.nbytes, dict(piece.meta), source, array)


def _view(buffer: np.ndarray | Tensor, entry: Entry, dtype: torch.dtype) -> Tensor:
    """A writable tensor over ``entry``'s bytes of ``buffer``."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return (raw if isinstance(raw, Tensor) else torch.from_numpy(raw)).view(dtype).reshape(entry.shape)


def detach(bucket: Bucket) -> Bucket:
    """``bucket`` with its own copy of the bytes, those read in an arena included (to keep it past
    the next one)."""
    buffer = np.zeros(sum(aligned(entry.nbytes) for entry in bucket.entries), dtype=np.uint8)
    entries, at = [], 0
    for entry in bucket.entries:
        if entry.source is not None:
            raw = read_slot(entry.source)
        elif entry.array is not None:
            raw = bucket.arrays[entry.array]
        else:
            raw = bucket.data[entry.offset :][: entry.nbytes]
        if isinstance(raw, Tensor):  # copied by torch: no NumPy view of the sender's tensor
            torch.from_numpy(buffer[at : at + entry.nbytes]).copy_(raw.reshape(-1).view(torch.uint8))
        else:
            buffer[at : at + entry.nbytes] = raw
        entries.append(replace(entry, offset=at, source=None, array=None))
        at += aligned(entry.nbytes)
    return Bucket(entries, buffer, bucket.index, bucket.sender, part=bucket.part, last=bucket.last)
