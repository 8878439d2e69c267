"""Buckets through node-local shared memory, the CPU counterpart of CUDA IPC: a sender packs each bucket into
one of its two shared-memory slots (`SharedSlots`) and sends its receivers on the node the slot's name and
byte range (`SlotRef`), which each maps once and reads in place (`read_slot`). A CPU trainer's parameters can
lie in shared memory too (`SharedArena`), read there: copied once, not twice.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_rl.device import copy_into

PREFIX = "moe_rl-sync-"
SHM_DIR = Path("/dev/shm")
_GENERATIONS = itertools.count(1)
"""Slot file names are new to this process: a receiver never mistakes one for a removed file it mapped."""


@dataclass(frozen=True)
class SlotRef:
    """Where a bucket's (or a part's) bytes are: ``nbytes`` from ``offset`` in the slot file ``path``."""

    path: str
    nbytes: int
    offset: int = 0


def slot_dir(nbytes: int) -> Path:
    """``/dev/shm`` with room for ``nbytes`` more, else the temporary folder (shared by the page cache)."""
    if SHM_DIR.is_dir() and shutil.disk_usage(SHM_DIR).free > 2 * nbytes:
        return SHM_DIR
    return Path(tempfile.gettempdir())


def _remove_stale(folder: Path) -> None:
    """Slot files of senders on this node that no longer run (``moe_rl-sync-<pid>-…``)."""
    for path in folder.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Slot:
    """One shared file, mapped writable by its sender."""

    @staticmethod
    def new(name: str, nbytes: int) -> _Slot:
        folder = slot_dir(nbytes)
        _remove_stale(folder)
        return _Slot(folder / f"{PREFIX}{os.getpid()}-{name}-{next(_GENERATIONS)}", nbytes)

    def __init__(self, path: Path, nbytes: int):
        self.path, self.nbytes = path, nbytes
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            self._map = mmap.mmap(f.fileno(), nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[:: mmap.PAGESIZE] = 0  # touch every page once: later buckets write to mapped pages

    def close(self) -> None:
        self.array = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self._map.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


class SharedSlots:
    """The sender's two slots of at least ``capacity`` bytes (one too small is replaced by a larger file under
    a new name); their files go at `close` or, if the sender died, with the next sender on the node."""

    def __init__(self, capacity: int, tag: str = "0"):
        if capacity <= 0:
            raise ValueError(f"shared slots need capacity > 0, got {capacity}")
        self.capacity, self.tag = capacity, tag
        self._slots: list[_Slot | None] = [None, None]
        self._finalizer = weakref.finalize(self, _close_all, self._slots)

    def buffer(self, index: int, nbytes: int) -> tuple[np.ndarray, str]:
        """A writable buffer of ``nbytes`` in slot ``index`` (modulo the slots), and its file's path."""
        i = index % len(self._slots)
        slot = self._slots[i]
        if slot is None or slot.nbytes < nbytes:
            if slot is not None:
                slot.close()
            slot = self._slots[i] = _Slot.new(f"{self.tag}-{i}", max(self.capacity, nbytes))
        return slot.array[:nbytes], str(slot.path)

    def nbytes(self) -> int:
        """Bytes of shared memory the slots hold."""
        return sum(slot.nbytes for slot in self._slots if slot is not None)

    def close(self) -> None:
        self._finalizer()


def _close_all(slots: list[_Slot | None]) -> None:
    for i, slot in enumerate(slots):
        if slot is not None:
            slot.close()
            slots[i] = None


ALIGN = 64
"""Byte alignment of each tensor in an arena or a bucket: a view of any dtype lines up (a float32
scale after an odd-sized e4m3 weight) and copies start on a cache line."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class SharedArena:
    """Tensors in one shared file of their owner (`sender.share_parameters`); `locate` says where a
    tensor lies. Only the owner writes it, between syncs (the optimizer steps in place); receivers
    read it during a sync, which the owner does not leave before every receiver has returned."""

    def __init__(self, nbytes: int, tag: str = "0"):
        if nbytes <= 0:
            raise ValueError(f"a shared arena needs nbytes > 0, got {nbytes}")
        self._slot = _Slot.new(f"{tag}-arena", nbytes)
        self.path, self.nbytes, self.used = str(self._slot.path), nbytes, 0
        self._base = self._slot.array.ctypes.data
        self._finalizer = weakref.finalize(self, self._slot.close)

    @staticmethod
    def size_for(tensors: Iterable[torch.Tensor]) -> int:
        """Bytes an arena needs to hold ``tensors`` (each aligned)."""
        return sum(aligned(tensor_nbytes(tensor)) for tensor in tensors)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor in the arena with ``tensor``'s dtype, shape and values."""
        offset, nbytes = aligned(self.used), tensor_nbytes(tensor)
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"shared arena {self.path} holds {self.nbytes} bytes; a {tuple(tensor.shape)} "
                f"{tensor.dtype} tensor at offset {offset} would end at {offset + nbytes}"
            )
        raw = torch.from_numpy(self._slot.array[offset : offset + nbytes])
        placed = raw.view(tensor.dtype).reshape(tensor.shape)
        copy_into(placed, tensor)
        self.used = offset + nbytes
        return placed

    def locate(self, tensor: torch.Tensor) -> SlotRef | None:
        """Where ``tensor``'s bytes lie in the arena; None unless it is a contiguous tensor inside it."""
        if self._slot.array is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset, nbytes = tensor.data_ptr() - self._base, tensor_nbytes(tensor)
        if nbytes == 0 or offset < 0 or offset + nbytes > self.nbytes:
            return None
        return SlotRef(self.path, nbytes, offset)

    def close(self) -> None:
        """Remove the file (tensors placed here stay valid: their mapping lives as long as they do)."""
        self._finalizer()


_MAPPED: dict[str, np.ndarray] = {}
"""Slot files this receiver process has mapped (read-only), by path."""


def read_slot(ref: SlotRef) -> np.ndarray:
    """The bucket bytes at ``ref``, read-only and without a copy (each slot file is mapped once per
    process; a sender's replacement file drops the mapping of the one it replaced)."""
    array = _MAPPED.get(ref.path)
    if array is None:
        _forget_replaced(ref.path)
        try:
            with open(ref.path, "rb") as f:
                array = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
        except FileNotFoundError as exc:
            raise RuntimeError(
                f"weight-sync slot {ref.path} is gone: its sender stopped or replaced it before this "
                "receiver read the bucket"
            ) from exc
        _MAPPED[ref.path] = array
    if ref.offset + ref.nbytes > array.nbytes:
        raise RuntimeError(
            f"weight-sync slot {ref.path} holds {array.nbytes} bytes, the bucket ends at {ref.offset + ref.nbytes}"
        )
    return array[ref.offset : ref.offset + ref.nbytes]


def _forget_replaced(path: str) -> None:
    """Drop the mappings of earlier files of the same sender slot (the name but the generation)."""
    stem = path.rsplit("-", 1)[0]
    for old in [p for p in _MAPPED if p.rsplit("-", 1)[0] == stem]:
        del _MAPPED[old]
