"""Device memory handed between processes of one machine by torch's own sharing: a sender's bucket buffer
travels as the handle torch's ``ForkingPickler`` makes of it (CUDA IPC on GPUs; a shared-memory file on CPU,
so the CPU tests run the same path), mapped once per sender slot by a receiver. Both sides wait for their
device (`ready`), so a buffer is reused only once every receiver has read it.
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
    key: tuple
    """(sender process, buffer slot): a receiver keeps one mapping per key."""
    offset: int
    nbytes: int


def share(buffer: torch.Tensor) -> bytes:
    """A handle of ``buffer`` (a whole, contiguous tensor) for other processes of this machine. A CPU
    buffer moves into shared memory here (the tensor object stays), so take views of it after."""
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


def close_opened() -> None:
    """Drop every sender buffer this process has mapped (a receiver, once its sync is done): a
    sender may then free its buffers between syncs (`moe_rl.weight_sync.transport.DeviceIpc.release`);
    the next sync's references are mapped anew."""
    _OPENED.clear()


def collect(device: torch.device | str) -> None:
    """Free the buffers this process shared whose receivers have dropped them (CUDA keeps a shared
    block until then); nothing to do on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.ipc_collect()
