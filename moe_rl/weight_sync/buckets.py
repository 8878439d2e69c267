"""Buckets: named tensors packed into one flat byte buffer, the unit that is published to engines.

A bucket holds whole groups (all the HF pieces of one Megatron tensor travel together, so a
receiver can fuse them on arrival) up to about ``capacity`` bytes; a group larger than that gets a
bucket of its own. The buffer is a NumPy ``uint8`` array: Ray publishes it out of band (one copy
into the object store, read without copying by every receiver on the node), and the packer reuses
one buffer for every bucket it fills, so a sender holds one buffer, not one per bucket.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

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


@dataclass
class Bucket:
    """Tensors in one flat buffer, ready to publish; `tensors` gives them back as views."""

    entries: list[Entry]
    buffer: np.ndarray
    """uint8, exactly ``nbytes`` long."""
    index: int = 0
    """Position in its sender's stream."""
    sender: int = 0
    """Trainer rank that sent it."""

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def tensors(self) -> Iterator[tuple[Entry, Tensor]]:
        """``(entry, tensor)`` views into the buffer (read-only when the buffer is)."""
        flat = torch.from_numpy(self.buffer) if self.buffer.flags.writeable else _readonly(self.buffer)
        for entry in self.entries:
            raw = flat[entry.offset : entry.offset + entry.nbytes]
            yield entry, raw.view(_DTYPES[entry.dtype]).reshape(entry.shape)


def _readonly(buffer: np.ndarray) -> Tensor:
    """A tensor over a read-only array (a published bucket): no copy; it must not be written."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(buffer)


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class BucketPacker:
    """Packs groups of ``(name, tensor, meta)`` into buckets of at most ``capacity`` bytes (a group
    larger than that: a bucket of its own), in order, in one working buffer that it keeps from sync
    to sync (grown to the largest group when one is larger than ``capacity``, never shrunk): a
    sender holds one buffer, whose pages are touched once.

    A yielded bucket's buffer is valid until the next bucket is requested. Publish it (``ray.put``
    copies it) or `detach` it before asking for the next.
    """

    def __init__(self, capacity: int, sender: int = 0):
        if capacity <= 0:
            raise ValueError(f"bucket capacity={capacity} bytes must be > 0")
        self.capacity, self.sender = capacity, sender
        self.buffer = np.empty(0, dtype=np.uint8)

    def pack(self, groups: Iterator[Sequence[tuple[str, Tensor, dict]]]) -> Iterator[Bucket]:
        entries: list[Entry] = []
        used = count = 0
        for group in groups:
            size = sum(t.numel() * t.element_size() for _, t, _ in group)
            if entries and used + size > self.capacity:
                yield Bucket(entries, self.buffer[:used], index=count, sender=self.sender)
                entries, used, count = [], 0, count + 1
            if used + size > self.buffer.nbytes:  # first use, or an oversized group alone in its bucket
                self.buffer = np.empty(max(self.capacity, size), dtype=np.uint8)
            for name, tensor, meta in group:
                entries.append(_write(self.buffer, used, name, tensor, meta))
                used += entries[-1].nbytes
        if entries:
            yield Bucket(entries, self.buffer[:used], index=count, sender=self.sender)


def pack_buckets(
    groups: Iterator[Sequence[tuple[str, Tensor, dict]]], capacity: int, sender: int = 0
) -> Iterator[Bucket]:
    """`BucketPacker.pack` with a packer of its own (a fresh buffer)."""
    return BucketPacker(capacity, sender).pack(groups)


def _write(buffer: np.ndarray, offset: int, name: str, tensor: Tensor, meta: dict) -> Entry:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which no bucket carries")
    nbytes = tensor.numel() * tensor.element_size()
    torch.from_numpy(buffer[offset : offset + nbytes]).copy_(_as_bytes(tensor))
    return Entry(name, dtype, tuple(tensor.shape), offset, nbytes, dict(meta))


def detach(bucket: Bucket) -> Bucket:
    """``bucket`` with its own copy of the bytes (to keep it past the next one)."""
    return Bucket(bucket.entries, bucket.buffer.copy(), bucket.index, bucket.sender)
