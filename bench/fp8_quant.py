"""Block-FP8 weight quantization throughput: ModelOpt vs the fused Triton kernel vs torch.compile.

Variants, run in one process on the same inputs:

* ``modelopt``: the old path, ModelOpt's ``FP8QTensor.quantize(w.float(), block_sizes=...)`` (an
  expert stack: one call per expert);
* ``quantize_fp8_block``: the project function (``moe_rl.quant.fp8_block``): one fused Triton
  kernel launch on CUDA, ModelOpt on CPU;
* ``torch.compile``: ``torch.compile`` of the same math written in plain torch (CUDA only).

Each output is compared with ModelOpt's bit for bit before timing (printed). Bytes per call are
the input's + the e4m3 data's + the fp32 scales' (everything read or written once: the minimum);
GB/s is that over the median time, and ``% copy`` its share of the device's copy bandwidth,
measured here first as the bytes read + written by ``dst.copy_(src)`` on a large bf16 tensor. On
CUDA the times are CUDA-event times of the GPU work (the queue is kept ahead of Python by a
``torch.cuda._sleep`` before each batch of calls, so launch overhead is not counted; ``wall ms``
is the wall time per call including it), and every launch configuration of the kernel
(``kernel_configs``) is timed too. On CPU (the default without CUDA) smaller shapes run, timed
with ``time.perf_counter`` on ``--threads`` torch threads (default 1), ModelOpt only: the Triton
kernel needs CUDA.

Cases on CUDA: (7168, 2048) and (2048, 7168) bf16, and a stack of 64 experts of 2048×7168 (the
expert shapes of DeepSeek-V3 / Kimi-K2). Not a test: numbers depend on the machine.

    python bench/fp8_quant.py [--device cuda] [--reps N] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for moe_rl

log = logging.getLogger("bench.fp8_quant")

BLOCK = 128
TARGET = 0.5  # of the copy bandwidth
CUDA_CASES = [(7168, 2048), (2048, 7168), (64, 2048, 7168)]
CPU_CASES = [(1792, 512), (512, 1792), (4, 512, 1792)]
Result = tuple[torch.Tensor, torch.Tensor]


def modelopt_old_path(weight: torch.Tensor, b: int = BLOCK) -> Result:
    """ModelOpt's `FP8QTensor`, as the sync quantized before the kernel (a stack: per expert)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    if weight.dim() == 3:
        parts = [modelopt_old_path(expert, b) for expert in weight.unbind(0)]
        return torch.stack([d for d, _ in parts]), torch.stack([s for _, s in parts])
    qtensor, scale = FP8QTensor.quantize(weight.float(), block_sizes={-1: b, -2: b})
    rows, cols = -(-weight.shape[0] // b), -(-weight.shape[1] // b)
    return qtensor._quantized_data.view(torch.float8_e4m3fn), scale.reshape(rows, cols).float()


def plain_fp8_block(weight: torch.Tensor, b: int = BLOCK) -> Result:
    """The same math in plain torch (for torch.compile): pad, block amax, /448, divide, cast, crop."""
    x = weight.float()
    *lead, rows, cols = x.shape
    pad_r, pad_c = -rows % b, -cols % b
    x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    blocks = x.reshape(*lead, (rows + pad_r) // b, b, (cols + pad_c) // b, b)
    scale = blocks.abs().amax(dim=(-3, -1)) / 448.0
    zero = (scale == 0)[..., :, None, :, None]
    q = torch.where(zero, 0.0, blocks / torch.where(zero, 1.0, scale[..., :, None, :, None]))
    data = q.to(torch.float8_e4m3fn).reshape(*lead, rows + pad_r, cols + pad_c)[..., :rows, :cols]
    return data, scale


def identical(got: Result, want: Result) -> bool:
    return got[0].shape == want[0].shape and bool(
        torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    )


def traffic_bytes(weight: torch.Tensor, b: int = BLOCK) -> int:
    *lead, rows, cols = weight.shape
    scales = -(-rows // b) * -(-cols // b) * (lead[0] if lead else 1)
    return weight.numel() * weight.element_size() + weight.numel() + scales * 4


def time_cpu(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median seconds, mean wall seconds) of `reps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), statistics.fmean(times)


def time_cuda(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median GPU seconds by CUDA events, wall seconds per call) of `reps` calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(50_000_000)  # ~25 ms of GPU clock: the calls below queue up behind it
    wall = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events), wall / reps


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes read + written per second by `dst.copy_(src)` on a large bf16 tensor."""
    numel = (1 << 29) if device.type == "cuda" else (1 << 26)  # 1 GiB on CUDA, 128 MiB on CPU
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    timer = time_cuda if device.type == "cuda" else time_cpu
    seconds, _ = timer(lambda: dst.copy_(src), max(reps, 5))
    return 2 * src.numel() * src.element_size() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed calls per variant (default 20 cuda, 3 cpu)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="cpu only: torch intra-op threads (1: steadier on a busy box)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False on this machine")
    cuda = device.type == "cuda"
    reps = args.reps or (20 if cuda else 3)
    if not cuda:
        torch.set_num_threads(args.threads)
    timer = time_cuda if cuda else time_cpu

    from moe_rl.quant.fp8_block import (
        _triton_quantize,
        kernel_configs,
        quantize_fp8_block,
        triton_path_available,
    )

    copy_bw = copy_bandwidth(device, reps)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} torch thread(s)"
    print(f"device: {name}; copy bandwidth (read + write): {copy_bw / 1e9:,.0f} GB/s; {reps} reps, median")
    if not cuda:
        print(
            "CPU: quantize_fp8_block is the ModelOpt path here (the Triton kernel needs CUDA); no torch.compile"
        )

    finals = []
    for shape in CUDA_CASES if cuda else CPU_CASES:
        g = torch.Generator(device=device).manual_seed(0)
        weight = (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        nbytes = traffic_bytes(weight)
        label = "×".join(map(str, shape)) + " bf16"
        path = "triton" if triton_path_available(weight) else "modelopt"
        variants: dict[str, Callable[[], Result]] = {
            "modelopt (old path)": lambda w=weight: modelopt_old_path(w),
            f"quantize_fp8_block ({path})": lambda w=weight: quantize_fp8_block(w, BLOCK),
        }
        if cuda:
            compiled = torch.compile(plain_fp8_block, dynamic=False)
            variants["torch.compile (plain torch)"] = lambda w=weight, f=compiled: f(w)
            if path == "triton":
                for config in kernel_configs(BLOCK)[1:]:
                    variants[f"  kernel config tile_rows={config[0]}, warps={config[1]}"] = (
                        lambda w=weight, c=config: _triton_quantize(w, BLOCK, config=c)
                    )
        reference = modelopt_old_path(weight)
        print(f"\n{label}: {nbytes / 1e6:,.1f} MB moved per call")
        print(f"  {'variant':44s} {'same bits':>9s} {'ms':>9s} {'wall ms':>9s} {'GB/s':>8s} {'% copy':>7s}")
        project_bw = 0.0
        for vname, fn in variants.items():
            same = identical(fn(), reference)
            seconds, wall = timer(fn, reps)
            bw = nbytes / seconds
            if vname.startswith("quantize_fp8_block"):
                project_bw = bw
            print(
                f"  {vname:44s} {'yes' if same else 'NO':>9s} {seconds * 1e3:9.3f} {wall * 1e3:9.3f} "
                f"{bw / 1e9:8.2f} {bw / copy_bw:7.1%}"
            )
        del reference
        finals.append(
            f"fp8 block quant {label}: {project_bw / 1e9:.2f} GB/s = {project_bw / copy_bw:.1%} of copy bandwidth "
            f"(target >= {TARGET:.0%})"
        )
    print()
    for line in finals:
        print(line)


if __name__ == "__main__":
    main()
