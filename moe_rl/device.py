"""Which device a process computes on: one device per process, owned by its worker or engine.

``run.device`` (``auto`` / ``cpu`` / ``cuda``) is resolved once against the machine
(`resolve_device`). A process that is to run on the CPU does not see CUDA at all: the Ray
actors of a CPU recipe get no GPU (Ray then hides every GPU from them) and the command line hides
the GPUs before torch starts (`hide_cuda_if_cpu`). So inside a process the device is simply
"CUDA if this process can see it" (`process_device`), and every component that holds a model
(the trainer worker, the Megatron engine, the diagnostics' reference model) asks this module,
never ``torch.cuda.is_available()`` on its own.

Tensors cross a process boundary (Ray, files) as CPU tensors; a worker moves what it computes
on to its device once, where it receives it, and moves results back to the CPU once, where it
returns them.

Imports torch lazily: `resolve_device` and `hide_cuda_if_cpu` run in the light command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch


class RunDevice(StrEnum):
    """What a recipe asks for (``run.device``): CUDA where the machine has it, the CPU, or CUDA."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


DeviceKind = Literal["cpu", "cuda"]
"""What a process computes on (torch's device type)."""
RUN_DEVICES: tuple[str, ...] = tuple(device.value for device in RunDevice)


@dataclass(frozen=True)
class Machine:
    """The accelerator of this machine, as far as placement and rollout engines care."""

    cuda: bool
    capability: tuple[int, int] | None = None
    """CUDA compute capability of device 0 (None without CUDA)."""

    @classmethod
    def detect(cls) -> Machine:
        import torch

        if not torch.cuda.is_available():
            return cls(cuda=False)
        return cls(cuda=True, capability=tuple(torch.cuda.get_device_capability(0)))


def resolve_device(run_device: str, machine: Machine) -> DeviceKind:
    """``run.device`` on this machine: ``auto`` is ``cuda`` where CUDA is present."""
    if run_device not in RUN_DEVICES:
        raise ValueError(f"run.device='{run_device}'; expected one of {', '.join(RUN_DEVICES)}")
    if run_device == RunDevice.AUTO:
        return "cuda" if machine.cuda else "cpu"
    if run_device == RunDevice.CUDA and not machine.cuda:
        raise ValueError("run.device=cuda but this machine has no CUDA device; use run.device=cpu or auto")
    return "cuda" if run_device == RunDevice.CUDA else "cpu"


def hide_cuda_if_cpu(run_device: str) -> bool:
    """Before torch touches CUDA: make a ``run.device=cpu`` process see no GPU. Returns whether
    it hid them. (Once CUDA is initialized, the process keeps the devices it saw.)"""
    if run_device != RunDevice.CPU:
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True


def machine_here(run_device: str) -> Machine:
    """This machine, as a command that runs a recipe here (``train``, ``diagnose``) sees it. With
    ``run.device=cpu`` the command hides the GPUs first (`hide_cuda_if_cpu`, before torch looks
    for CUDA) and sees none; otherwise it sees what torch finds. A recipe is checked against this
    machine, not the one its ``cluster`` section describes: ``auto`` on a CPU cluster recipe still
    runs on the GPU of the machine it is started on."""
    if hide_cuda_if_cpu(run_device):
        return Machine(cuda=False)
    return Machine.detect()


def process_device() -> torch.device:
    """The device of this process: its current CUDA device where it sees CUDA, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_process_device(run_device: str) -> torch.device:
    """`process_device`, refusing a recipe whose ``run.device`` disagrees with what this process
    sees (``cpu`` with CUDA visible, ``cuda`` without it)."""
    device = process_device()
    if run_device not in RUN_DEVICES:
        raise ValueError(f"run.device='{run_device}'; expected one of {', '.join(RUN_DEVICES)}")
    if run_device not in (RunDevice.AUTO, device.type):
        raise ValueError(
            f"run.device={run_device} but this process computes on {device.type}: a CPU run must not see "
            "CUDA (set CUDA_VISIBLE_DEVICES= before starting it, as `moe-rl` and the Ray actors do) "
            "and a CUDA run needs a visible GPU"
        )
    return device


NON_TEMPORAL_COPY_BYTES = 4 << 20
"""Byte copies (``memmove``) from this size on write around the caches (non-temporal stores) in the
processes of a run, which start with `COPY_TUNABLES`. glibc switches to such stores only above
``glibc.cpu.x86_non_temporal_threshold``, by default about 3/4 of the last-level cache it detects
(114 MB on a machine reporting 300 MB). Below it every destination line is read before it is
written, so a 28 MB expert weight copied on one thread moves ~7.4 GB/s here against ~10.8 GB/s with
non-temporal stores; two engines loading at once, 14 against 18.5 GB/s together. A weight that has
just been copied is not read again soon, so nothing is lost by keeping it out of the caches."""
COPY_TUNABLES = f"glibc.cpu.x86_non_temporal_threshold={NON_TEMPORAL_COPY_BYTES:#x}"
"""``GLIBC_TUNABLES`` of a process that copies weights: read once, when the process starts (glibc
ignores it on machines where the setting does not exist)."""

PARALLEL_COPY_BYTES = 8 << 20
"""Tensors from this size on are copied by several threads when `copy_into` is given them."""
_COPY_POOL = None
"""``(workers, executor)`` of the threads `copy_into` copies on besides the caller's."""


def copy_into(target: torch.Tensor, source: torch.Tensor, threads: int = 1) -> None:
    """``target.copy_(source)``; between contiguous CPU tensors of one dtype and shape, a plain byte
    copy (NumPy's ``memmove``, which runs about 1.5x faster than torch's ``copy_`` on one thread), on
    the calling thread, or split over ``threads`` threads for a large tensor. Weight-sync senders and
    the engines loading what they send share a node's cores: each side copies with the threads it
    is given (a sender: one, the engines its receivers need the others). Large copies are fastest
    in a process started with `COPY_TUNABLES`, as the run's processes are."""
    source = source.detach()
    if (
        source.device.type == "cpu"
        and target.device.type == "cpu"
        and source.dtype == target.dtype
        and source.shape == target.shape
        and source.is_contiguous()
        and target.is_contiguous()
        and source.numel() > 0
    ):
        import numpy as np

        dst, src = transient_bytes(target), transient_bytes(source)
        if threads > 1 and dst.nbytes >= PARALLEL_COPY_BYTES:
            _parallel_copy(dst, src, threads)
        else:
            np.copyto(dst, src)
    else:
        target.copy_(source)


def _parallel_copy(dst, src, threads: int) -> None:
    """``dst[:] = src`` in ``threads`` chunks at once (NumPy releases the GIL while it copies)."""
    import concurrent.futures
    import itertools

    import numpy as np

    global _COPY_POOL
    if _COPY_POOL is None or _COPY_POOL[0] < threads - 1:
        _COPY_POOL = (
            threads - 1,
            concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="copy"),
        )
    pool = _COPY_POOL[1]
    bounds = [dst.nbytes * i // threads for i in range(threads + 1)]
    chunks = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    futures = [pool.submit(np.copyto, dst[c], src[c]) for c in chunks[1:]]
    np.copyto(dst[chunks[0]], src[chunks[0]])
    for future in futures:
        future.result()


def transient_bytes(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a flat NumPy ``uint8`` array (no copy), made from its
    address: `Tensor.numpy` would mark its storage as not resizable for good, so that it could no
    longer leave memory between phases (`moe_rl.offload`). Valid only while the storage is neither resized nor freed: for the length of
    one copy or one pickling, never kept."""
    import ctypes

    import numpy as np

    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr()))
