"""Device memory handed between processes of one machine by torch's own sharing: a sender's bucket
buffer travels as a handle (what torch's ``ForkingPickler`` makes of it: on CUDA an IPC handle of the
allocation, so a trainer rank and the Megatron engine on its GPU exchange weights GPU to GPU; on CPU
a shared-memory file's name, which is how the CPU tests run the same path), and a receiver maps the
same memory once per sender slot (`IpcRef.key`), again when the sender hands a new buffer there.

The sender makes its writes visible before it hands a handle and a receiver finishes reading before
its delivery returns (`ready`), so a buffer is reused only after every receiver has read it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

_OPENED: dict[tuple, tuple[bytes, torch.Tensor]] = {}
"""(sender, slot) -> (handle, mapped buffer) in a receiving process."""


@dataclass(frozen=True)
class IpcRef:
    """Where a bucket's bytes lie in a sender's shared device buffer."""

    handle: bytes
    """The buffer as torch's multiprocessing pickler wrote it."""
    key: tuple
    """(sender process, buffer slot): a receiver keeps one mapping per key."""
    offset: int
    nbytes: int


def share(buffer: torch.Tensor) -> bytes:
    """A handle of ``buffer`` (a whole, contiguous tensor: its storage is what is shared) for other
    processes of this machine. A CPU buffer moves into shared memory here (once; the tensor object
    stays the same), so take views of it after sharing it."""
    if not buffer.is_contiguous() or buffer.storage_offset() != 0:
        raise ValueError("only a whole contiguous buffer is shared (not a view into another tensor)")
    out, before = io.BytesIO(), torch_mp.get_sharing_strategy()
    # CPU storages as shared-memory file names, which any process of the machine can open (the
    # default, file descriptors, only reaches a process the sender started)
    torch_mp.set_sharing_strategy("file_system")
    try:
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(buffer)
    finally:
        torch_mp.set_sharing_strategy(before)
    return out.getvalue()


def ready(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` is done (a no-op on CPU): a sender before it hands a
    handle, a receiver before it says it has read the bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_ref(ref: IpcRef) -> torch.Tensor:
    """The bytes of ``ref`` (a uint8 view of the sender's buffer, on the device that holds it)."""
    kept = _OPENED.get(ref.key)
    if kept is None or kept[0] != ref.handle:
        _OPENED[ref.key] = kept = (ref.handle, pickle.loads(ref.handle))
    buffer = kept[1]
    if ref.offset + ref.nbytes > buffer.numel():
        raise RuntimeError(
            f"shared weight-sync buffer {ref.key} holds {buffer.numel()} bytes, the bucket ends at "
            f"{ref.offset + ref.nbytes}"
        )
    return buffer[ref.offset : ref.offset + ref.nbytes]
