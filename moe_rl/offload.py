"""Giving memory back between phases and taking it again, without changing any tensor object.

A tensor's storage is copied to host memory (pinned when it lies on a GPU) and resized to nothing;
every tensor and view over it (a parameter, its ``main_grad`` in a gradient buffer, an optimizer's
moment) stays the object it was, so the optimizer, the gradient hooks and the weight sync keep
their references. Restoring resizes the storage back and copies the bytes in. With ``keep=False``
nothing is copied out and only the room comes back: for storages whose next writer fills them
whole (an engine's weights, which the next weight sync writes).

A storage that cannot be resized (one in a shared-memory file, as a CPU trainer's parameters for
the weight sync) stays where it is and counts as resident. Imports nothing heavy but torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

GIB = float(1 << 30)


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None


@dataclass
class Offload:
    """The storages of some tensors (`add`), released (`release`) and restored (`restore`) as one."""

    name: str
    held: list[_Held] = field(default_factory=list)
    fixed: int = 0
    """Bytes of storages that cannot be resized (they stay resident)."""
    out: bool = False
    releases: int = 0
    """How many times it was released."""

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take the storages of ``tensors`` (each once, however many tensors view it)."""
        seen = {h.storage.data_ptr() for h in self.held}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() == 0 or ptr in seen:
                continue
            seen.add(ptr)
            if storage.resizable():
                self.held.append(_Held(storage, storage.nbytes()))
            else:
                self.fixed += storage.nbytes()

    @property
    def nbytes(self) -> int:
        """Bytes of every storage taken, resident or not."""
        return sum(h.nbytes for h in self.held) + self.fixed

    @property
    def resident(self) -> int:
        """Bytes of the storages in memory now."""
        return sum(h.storage.nbytes() for h in self.held) + self.fixed

    def release(self, keep: bool = True) -> int:
        """Copy each storage out (``keep``) and free it; the bytes freed."""
        if self.out:
            raise RuntimeError(f"{self.name}: released twice without a restore")
        freed = 0
        for held in self.held:
            if not held.storage.resizable():  # became a NumPy array's since `add`: it stays resident
                continue
            if keep:
                view = _bytes(held.storage)
                pin = view.device.type == "cuda"
                held.host = torch.empty(held.nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
                held.host.copy_(view, non_blocking=pin)
        if any(h.host is not None and h.host.is_pinned() for h in self.held):
            torch.cuda.synchronize()  # the copies out have landed before the memory is freed
        for held in self.held:
            if held.storage.resizable():
                freed += held.storage.nbytes()
                held.storage.resize_(0)
        if any(h.storage.device.type == "cuda" for h in self.held):
            torch.cuda.empty_cache()  # back to the device, for the other process on this GPU
        self.out, self.releases = True, self.releases + 1
        return freed

    def restore(self) -> int:
        """Give each storage its room back, with its bytes where they were kept; the bytes restored."""
        if not self.out:
            raise RuntimeError(f"{self.name}: restored without a release")
        for held in self.held:
            if held.storage.nbytes() == held.nbytes:  # never left (see `release`)
                continue
            held.storage.resize_(held.nbytes)
            if held.host is not None:
                _bytes(held.storage).copy_(held.host, non_blocking=held.host.is_pinned())
        if any(h.host is not None and h.host.is_pinned() for h in self.held):
            torch.cuda.synchronize()
        for held in self.held:
            held.host = None
        self.out = False
        return sum(h.nbytes for h in self.held)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat byte tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` as they are now (released ones count 0)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())  # one entry per storage, however many views
    return sum(seen.values())
