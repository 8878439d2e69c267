"""Buckets: named tensors packed into one flat byte buffer, the unit a sender hands its receivers. A bucket
holds whole groups (all the HF pieces of one Megatron tensor, fused on arrival) up to about ``capacity``
bytes, in buffers the packer keeps, so a sender holds at most two buckets' worth.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from moe_rl.device import transient_bytes
from moe_rl.weight_sync.ipc import IpcRef, open_ref
from moe_rl.weight_sync.shm import ALIGN, SharedArena, SharedSlots, SlotRef, aligned, read_slot
from moe_rl.weight_sync.wire import LazyGroup, Piece

PART_BYTES = 128 << 20
"""Default size of the parts a bucket in a shared slot travels in: small enough that receivers start
early, large enough that a part's delivery (one call per receiver) costs little next to reading it."""

SLACK = 64 * ALIGN
"""Room a bucket's buffer has beyond its capacity for the padding of its tensors (`shm.ALIGN`)."""


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
    nbytes: int
    meta: dict = field(default_factory=dict)
    """What the wire format needs to decode it (e.g. the FP8 block shape)."""
    source: SlotRef | None = None
    """Where the tensor lies in its sender's shared arena, when it is not in the buffer."""
    array: int | None = None
    """Which of the bucket's `Bucket.arrays` holds the tensor, when it is not in the buffer."""


@dataclass
class Bucket:
    """Tensors in one flat buffer, bucket ``index`` of trainer rank ``sender``'s stream, or a ``part`` of it
    (`BucketPacker`: ``last`` marks the last); `tensors` gives them back as views."""

    entries: list[Entry]
    buffer: np.ndarray | Tensor | None
    """uint8: the written entries at `ALIGN`-ed offsets (a slot or device buffer: mapped at `data`)."""
    index: int = 0
    sender: int = 0
    slot: SlotRef | None = None
    """The shared-memory slot holding the bytes; then only the entries and this travel."""
    part: int = 0
    last: bool = True
    arrays: list[np.ndarray | Tensor] = field(default_factory=list)
    """Tensors that travel as the sender holds them (flat ``uint8`` views), torch views until pickled:
    a NumPy view would mark the parameter's storage as not resizable, so it could no longer leave
    memory between phases (`moe_rl.offload`)."""
    ipc: IpcRef | None = None
    """Where the bytes lie in the sender's shared device buffer; then only the entries and this travel."""

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
        """``(entry, tensor)`` views, valid while the bucket is handled: copy what is kept longer."""
        flat = None
        for entry in self.entries:
            if entry.source is not None:
                raw = _tensor(read_slot(entry.source))
            elif entry.array is not None:
                raw = _tensor(self.arrays[entry.array])
            else:
                flat = _tensor(self.data) if flat is None else flat
                raw = flat[entry.offset : entry.offset + entry.nbytes]
            yield entry, raw.view(_DTYPES[entry.dtype]).reshape(entry.shape)


def _tensor(buffer: np.ndarray | Tensor) -> Tensor:
    """A tensor over ``buffer``, no copy (over a read-only array, a published bucket, not to be written)."""
    if isinstance(buffer, Tensor):
        return buffer
    if buffer.flags.writeable:
        return torch.from_numpy(buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(buffer)


class BucketPacker:
    """Packs groups (`wire.LazyGroup`) into buckets of at most ``capacity`` bytes, in order, into
    buffers it keeps from sync to sync (grown for a larger group, never shrunk), with `SLACK` bytes
    beyond ``capacity`` for the tensors' padding (a bucket whose padding would overflow them ends
    early). Bucket ``i`` is valid until the packer comes back to its buffer:

    * without ``slots``: bucket ``i`` in buffer ``i % buffers`` (NumPy, or a tensor on ``device``
      that a transport hands by IPC handle). A contiguous CPU tensor that travels as it is
      (`wire.Piece.source`) is not written into a NumPy buffer: it is carried as it lies (`Bucket.arrays`);
    * with ``slots`` (`shm.SharedSlots`): bucket ``i`` in slot ``i % 2``, yielded in parts of about
      ``part_bytes`` (whole groups), each once written, so receivers read the start of a bucket while
      the sender writes the rest. A tensor that travels as it is and lies in ``arena``
      (`shm.SharedArena`) is not written: its entry points there.
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
        self.buffers: list[np.ndarray | Tensor] = [self._new(0) for _ in range(max(1, buffers))]

    def _new(self, nbytes: int) -> np.ndarray | Tensor:
        if self.device is None:
            return np.empty(nbytes, dtype=np.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _target(self, index: int, size: int) -> tuple[np.ndarray, str | None]:
        size = max(size, self.capacity + SLACK)
        if self.slots is not None:
            return self.slots.buffer(index, size)
        i = index % len(self.buffers)
        if size > self.buffers[i].nbytes:
            self.buffers[i] = self._new(size)
        return self.buffers[i], None

    def pack(self, groups: Iterator[LazyGroup]) -> Iterator[Bucket]:
        """Buckets (or parts) of ``groups``, each written in place; a part is yielded once the next group is
        known to go into the same bucket (the last part is never empty)."""
        entries: list[Entry] = []
        used = start = count = part = 0  # bytes written into this bucket's buffer; where this part's begin
        size = part_size = 0  # bytes of this bucket and of this part, those not written included
        arrays: list[np.ndarray | Tensor] = []  # this bucket's tensors carried as they lie (no slots)
        target, path = None, None

        def bucket(last: bool) -> Bucket:  # bytes start:used of the target (entries count from start)
            slot = SlotRef(path, used - start, start) if path is not None else None
            return Bucket(entries, target[start:used], count, self.sender, slot, part, last, arrays)

        for lazy in groups:
            sources = [self._unwritten(piece) for piece in lazy.pieces]
            written = sum(aligned(p.nbytes) for p, at in zip(lazy.pieces, sources, strict=True) if at is None)
            if entries and (size + lazy.nbytes > self.capacity or used + written > target.nbytes):
                yield bucket(True)
                entries, used, start, size, part_size, count, part = [], 0, 0, 0, 0, count + 1, 0
                target, arrays = None, []
            elif entries and self.part_bytes is not None and part_size >= self.part_bytes:
                yield bucket(False)
                entries, start, part_size, part = [], used, 0, part + 1
            if target is None or used + written > target.nbytes:  # a new bucket, or an oversized group
                target, path = self._target(count, written)
            views: list[Tensor | None] = []
            for piece, at in zip(lazy.pieces, sources, strict=True):
                view = None
                if isinstance(at, SlotRef):
                    entries.append(_entry(piece, 0, source=at))
                elif at is not None:
                    entries.append(_entry(piece, 0, array=len(arrays)))
                    arrays.append(at.detach().reshape(-1).view(torch.uint8))
                else:
                    entries.append(_entry(piece, used - start))
                    view = _tensor(target[used : used + piece.nbytes]).view(piece.dtype).reshape(piece.shape)
                    target[used + piece.nbytes : used + aligned(piece.nbytes)] = 0  # no stray bytes travel
                    used += aligned(piece.nbytes)
                views.append(view)
            size += lazy.nbytes
            part_size += lazy.nbytes
            lazy.fill(views)
        if entries:
            yield bucket(True)

    def _unwritten(self, piece: Piece) -> SlotRef | Tensor | None:
        """How ``piece`` travels unwritten (its `SlotRef` in the arena, or itself as it lies), else None."""
        source = piece.source
        if source is None or source.dtype != piece.dtype or source.numel() == 0:
            return None
        if self.slots is not None:
            return self.arena.locate(source) if self.arena is not None else None
        if self.device is None and source.device.type == "cpu" and source.is_contiguous():
            return source
        return None


def _entry(piece: Piece, offset: int, source: SlotRef | None = None, array: int | None = None) -> Entry:
    dtype = str(piece.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"weight {piece.name!r} has dtype {piece.dtype}, which no bucket carries")
    return Entry(piece.name, dtype, piece.shape, offset, piece.nbytes, dict(piece.meta), source, array)
