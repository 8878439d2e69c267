"""Timing and peak-memory helpers shared by bench/algo_*.py (not a test; prints measured numbers).

Peak memory is the extra memory an operation needs above what is live when it starts:

* CUDA: ``torch.cuda.max_memory_allocated() − torch.cuda.memory_allocated()`` after
  ``reset_peak_memory_stats()`` (the caching allocator's exact high-water mark).
* CPU: the process's peak resident set size. Before the operation the kernel's high-water mark
  is reset (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0), then ``VmHWM − VmRSS`` is read
  from ``/proc/self/status``. glibc serves large tensors with mmap and returns them on free, so
  this captures every transient allocation of the operation (page granularity, ~MB noise).
  Where ``clear_refs`` is not writable the figure is reported as n/a. Before measuring,
  ``malloc_trim(0)`` returns freed heap pages to the kernel, so that memory freed by earlier
  operations (still resident) cannot hide this operation's allocations.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for moe_rl

_LIBC = None
with contextlib.suppress(OSError):  # not glibc: freed-but-resident heap may hide small allocations
    _LIBC = ctypes.CDLL("libc.so.6")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (CI smoke run)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="logits dtype (default fp32 on cpu, bf16 on cuda)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (median reported)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve_device(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False on this machine")
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    return torch.device(args.device), dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Extra peak memory of one call of `fn` (see module docstring); None if unmeasurable."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status()["VmRSS"]
    except OSError:
        return None
    fn()
    return max(0, _proc_status()["VmHWM"] - before)


def fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"
