"""Giving memory back between phases and taking it again, without changing any tensor object.

A tensor's storage is copied to host memory (pinned when it lies on a GPU) and resized to nothing;
every tensor and view over it (a parameter, its ``main_grad`` in a gradient buffer, an optimizer's
moment) stays the object it was, so the optimizer, the gradient hooks and the weight sync keep
their references. Restoring resizes the storage back and copies the bytes in. With ``keep=False``
nothing is copied out and only the room comes back: for storages whose next writer fills them
whole (an engine's weights, which the next weight sync writes).

A storage that cannot be resized (one in a shared-memory file, as a CPU trainer's parameters for
the weight sync) stays where it is and counts as resident. Imports nothing heavy but torch.

What a process holds on a GPU as the driver counts it (its CUDA context, the caching allocator's
segments, library workspaces), not the bytes of its tensors, is `DriverMemory`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

GIB = float(1 << 30)
log = logging.getLogger(__name__)


class DriverMemory:
    """This process's memory on its CUDA device as the driver counts it (NVML's per-process figure)
    and the device's memory in use by every process (``cudaMemGetInfo``). ``context`` is what the
    process held when this was made, before it allocated anything: its CUDA context, which only
    the process's end gives back. On a CPU there is no driver figure: `process_bytes` is NaN and
    `readings` empty."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._handle = None
        self.context = math.nan
        if device.type != "cuda":
            return
        torch.zeros(1, device=device)  # the context is made now, not at the first allocation
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            )
        except Exception as exc:  # no NVML: the device-wide figure remains
            log.warning("NVML cannot tell this process's GPU memory (%s: %s)", type(exc).__name__, exc)
        self.context = self.process_bytes()

    def process_bytes(self) -> float:
        """Bytes this process holds on the device; NaN where NVML does not list it."""
        if self._handle is None:
            return math.nan
        import pynvml

        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return float(proc.usedGpuMemory)
        return math.nan

    def readings(self, role: str, phase: str) -> dict[str, float]:
        """Metrics of ``role`` (trainer, engine) after ``phase``, in GiB: ``memory/{role}_{phase}_device_gib``
        (this process, by the driver), ``memory/{role}_{phase}_reserved_gib`` (the part the caching
        allocator holds: what a phase can give back; the rest is the context, the kernels loaded into
        it and the libraries' handles), ``memory/{role}_{phase}_gpu_used_gib`` (every process on the
        device) and ``memory/{role}_context_gib``; nothing on a CPU."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            f"memory/{role}_{phase}_device_gib": self.process_bytes() / GIB,
            f"memory/{role}_{phase}_reserved_gib": torch.cuda.memory_reserved(self.device) / GIB,
            f"memory/{role}_{phase}_gpu_used_gib": (total - free) / GIB,
            f"memory/{role}_context_gib": self.context / GIB,
        }


def release_device_cache() -> None:
    """What the process's CUDA libraries keep beyond its tensors, back to the device for the other
    process on this GPU: cuBLAS's workspaces (allocated from the caching allocator, 32 MiB by
    default, and not freed by ``empty_cache``; made again at the next matrix product), then the
    allocator's free segments."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


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
            release_device_cache()
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
