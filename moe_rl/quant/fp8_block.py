"""Block-FP8 (e4m3) weight quantization for vLLM's block-FP8 linear method, as one fused Triton kernel.

What it computes
----------------
For a weight ``W`` ([out, in], or a stack of experts [E, out, in]) and a block size ``b`` (128 in
DeepSeek-V3 / Kimi-K2 checkpoints), every ``b×b`` block ``B`` of ``W`` gets::

    x     = W.float()                 (bf16 / fp16 → fp32 is exact)
    amax  = max |x| over B            (a partial last block counts only its real elements:
                                       ModelOpt pads with zeros, which change no amax)
    scale = amax / 448                (fp32; 448 = e4m3 max; how it rounds depends on the
                                       device, as ModelOpt's does: see below)
    data  = e4m3(x / scale)           (fp32 IEEE division, then round-to-nearest-even cast)

returned as ``(data, scale)``: ``data`` float8_e4m3fn with W's shape, ``scale`` float32 of shape
[ceil(out/b), ceil(in/b)] (or [E, ceil(out/b), ceil(in/b)]), ``W ≈ data.float() * scale``
blockwise: vLLM's ``weight`` and ``weight_scale_inv``. This is NVIDIA ModelOpt's
``FP8QTensor.quantize(W.float(), block_sizes={-1: b, -2: b})``, with one documented exception
(zero blocks, below).

Paths
-----
* A CUDA tensor of bf16 / fp16 / fp32 on an NVIDIA GPU of compute capability ≥ 9.0 (H100, H200,
  B200) with Triton importable: one launch of a fused Triton kernel (grid over experts × row
  blocks × column blocks; each program reads its block once, reduces the amax, divides, casts and
  writes): one read of the input and one write of the outputs, 3 bytes per bf16 element.
* Everything else (CPU tensors, no Triton, ROCm, GPUs below sm_90, other float dtypes): the same
  arithmetic in torch operations, a few row blocks at a time (``torch_fp8_block``), on the tensor's
  device, so its temporaries stay a few MB whatever the weight's size (ModelOpt makes several
  full-size float32 copies, and is ~100× slower on CPU). Below sm_90 the Triton cast is not the one
  torch does: on sm_89 Triton converts fp32 → e4m3 by rounding to fp16 toward zero first (a double
  rounding), and older GPUs have no e4m3 at all. Both paths are tested against ModelOpt itself.

Outputs are on the input's device; nothing is moved between devices.

Bit-identity contract
---------------------
The Triton kernel's and the torch path's ``data`` and ``scale`` equal ModelOpt's (run on the same
tensor), compared as
raw bytes, on every block whose elements are all finite, subnormal ones included; blocks whose
scale is 0 follow the zero-block rule below. What that rests on (read from the PTX that Triton 3.6,
torch 2.11's, and 3.9 emit for sm_90):

* ``scale``: ModelOpt computes ``amax / 448.0``, a tensor divided by a Python number. On the CPU
  torch divides (IEEE round-to-nearest). On CUDA torch multiplies by the divisor's fp32 reciprocal
  instead (``amax * fl(1/448)``, ``div_true_kernel_cuda``), which differs from the division by an
  ulp in about half the blocks. The kernel runs on CUDA, so it multiplies by the same fp32
  reciprocal (``RECIPROCAL``); under the interpreter, on CPU tensors, it divides like the CPU.
  The torch path needs nothing: its ``/ 448.0`` is the same torch operation on the same device.
* ``x / scale`` is a division of two tensors, IEEE round-to-nearest on either device; the kernel
  uses ``tl.math.div_rn`` (``div.rn.f32``). Triton's plain ``/`` on fp32 lowers to
  ``div.full.f32`` on NVIDIA, an approximate division (≤ 2 ulp) that flips ``x / scale`` across
  e4m3 rounding boundaries.
* No flush-to-zero: ``div.rn.f32`` carries no ``.ftz``, the fp32 multiply keeps subnormals too
  (blocks whose scale is fp32-subnormal match ModelOpt on an H200) and the amax is an integer
  reduction, so blocks of tiny values round as torch rounds them.
* The cast is Triton's native fp32 → e4m3 conversion (``cvt.rn.satfinite.e4m3x2.f32``),
  round-to-nearest-even like torch's. Out-of-range handling never matters:
  ``|x / scale| ≤ 448·(1 + 2⁻²³)``, which rounds to 448 in both.
* The amax is ``max |x|`` with NaN propagation, as ``torch.amax`` gives it: the max of the int32
  bit patterns of ``|x|``, which order like the floats, with NaN above +Inf.
* Non-finite blocks come out as in ModelOpt: a block holding a NaN gets scale NaN and NaN data; one
  holding ±Inf (and no NaN) gets scale +Inf, NaN where x is ±Inf and ±0 elsewhere. NaN bit
  patterns (sign, payload) are not part of the contract; NaN positions are.

Zero blocks
-----------
ModelOpt turns a block whose scale is 0 (all its elements are ±0, or, fp32 input only, its amax
is at most 448·2⁻¹⁵⁰ so that amax / 448 underflows) into data ``x / 0``: NaN (0/0; byte 0xFF on
x86) for the zeros and ±Inf, cast to ±448 by torch, for the rest. That would put NaN weights into
the engine. Here such a block gets scale 0 and data +0 (byte 0x00) on every path: it dequantizes to
exactly zero.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("moe_rl.quant.fp8_block")

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_CAPABILITY = (9, 0)  # native RNE fp32 → e4m3 conversion in Triton (see module docstring)
INV_FP8_MAX = (torch.tensor(1.0) / 448.0).item()
"""fl(1/448) in fp32 (exact as a Python float): torch's CUDA ``amax / 448.0`` is ``amax * INV_FP8_MAX``."""
_MAX_TILE = 128  # a program holds at most a 128×128 tile in registers; larger blocks take two passes


def _check(weight: torch.Tensor, block_size: int) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() not in (2, 3):
        raise ValueError(
            f"weight must be 2-D [out, in] or 3-D [experts, out, in], got {weight.dim()}-D shape "
            f"{tuple(weight.shape)}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must have a floating-point dtype, got dtype={weight.dtype}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_shape(shape: torch.Size, block_size: int) -> tuple[int, ...]:
    return (*shape[:-2], _cdiv(shape[-2], block_size), _cdiv(shape[-1], block_size))


def _empty_result(weight: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.zeros(_scale_shape(weight.shape, block_size), dtype=torch.float32, device=weight.device)
    return data, scale


def _zero_blocks_to_zero(data: torch.Tensor, scale: torch.Tensor, block_size: int) -> None:
    """The zero-block rule, in place: data of blocks with scale 0 becomes +0 (ModelOpt gives 0/0 = NaN)."""
    zero = scale == 0
    if not bool(zero.any()):
        return
    raw, b = data.view(torch.uint8), block_size
    for *lead, r, c in zero.nonzero().tolist():  # block by block: no full-size mask
        raw[(*lead, slice(r * b, (r + 1) * b), slice(c * b, (c + 1) * b))] = 0


CHUNK_ELEMENTS = 1 << 20
"""Elements of a weight the torch path holds as float32 at a time (whole row blocks; at least one)."""


def torch_fp8_block(
    weight: torch.Tensor, block_size: int = 128, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantization in torch operations, a few row blocks at a time (the zero-block rule
    applied). The path `quantize_fp8_block` takes without the Triton kernel. ``out``: contiguous
    ``(data, scale)`` tensors of the result's dtypes and shapes to write into (e.g. a bucket)."""
    _check(weight, block_size)
    data, scale = out if out is not None else _empty_result(weight, block_size)
    scale_shape = _scale_shape(weight.shape, block_size)
    if (data.dtype, tuple(data.shape), scale.dtype, tuple(scale.shape)) != (
        torch.float8_e4m3fn,
        tuple(weight.shape),
        torch.float32,
        scale_shape,
    ):
        raise ValueError(
            f"out= must be float8_e4m3fn {tuple(weight.shape)} and float32 {scale_shape}, got "
            f"{data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}"
        )
    if weight.numel() == 0:
        return data, scale
    for w, d, s in zip(weight.reshape(-1, *weight.shape[-2:]), data.view(-1, *data.shape[-2:]),
                       scale.view(-1, *scale.shape[-2:])):  # fmt: skip
        _torch_2d(w, d, s, block_size)
    _zero_blocks_to_zero(data, scale, block_size)
    return data, scale


def _torch_2d(weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, b: int) -> None:
    """Fill ``data`` and ``scale`` of one 2-D weight, row blocks by row blocks: ``amax`` over each
    zero-padded block, ``scale = amax / 448``, ``data = e4m3(x / scale)`` (IEEE division), in two
    float32 scratch tensors of one chunk that every chunk reuses."""
    rows, cols = weight.shape
    col_blocks = _cdiv(cols, b)
    step = min(max(1, CHUNK_ELEMENTS // (b * col_blocks * b)), _cdiv(rows, b)) * b
    x = torch.zeros(step, col_blocks * b, dtype=torch.float32, device=weight.device)  # padding stays 0
    magnitude = torch.empty_like(x)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        row_blocks = _cdiv(n, b)
        chunk = x[: row_blocks * b]
        chunk[:n, :cols].copy_(weight[start : start + n])
        chunk[n:].zero_()  # the last chunk's padding rows
        blocks = chunk.view(row_blocks, b, col_blocks, b)
        torch.abs(chunk, out=magnitude[: row_blocks * b])
        block_scale = magnitude[: row_blocks * b].view(row_blocks, b, col_blocks, b).amax(dim=(1, 3)) / 448.0
        scale[start // b : start // b + row_blocks] = block_scale
        blocks.div_(block_scale[:, None, :, None])
        data[start : start + n].copy_(chunk[:n, :cols])  # the round-to-nearest-even e4m3 cast


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        log.debug("triton is not importable: block-FP8 quantization runs in torch operations")
        return False
    return True


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def triton_path_available(weight: torch.Tensor) -> bool:
    """Whether `quantize_fp8_block(weight)` runs the fused Triton kernel (else `torch_fp8_block`)."""
    if not weight.is_cuda or weight.dtype not in _TRITON_DTYPES or torch.version.hip is not None:
        return False
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    if _capability(index) < _MIN_CAPABILITY:
        return False
    return _triton_importable()


def quantize_fp8_block(weight: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantization of a 2-D weight [out, in] or a 3-D expert stack [E, out, in].

    Returns ``(data, scale)``: float8_e4m3fn data of `weight`'s shape and float32 scales
    [ceil(out/b), ceil(in/b)] (3-D: [E, ceil(out/b), ceil(in/b)]), on `weight`'s device, with
    ``weight ≈ data.float() * scale`` blockwise. On CUDA (sm_90+, Triton importable) one fused
    Triton kernel launch; elsewhere `torch_fp8_block`. Bit-identical to ModelOpt except that all-zero blocks
    give scale 0 and data 0 instead of NaN (see the module docstring for the exact contract).
    """
    _check(weight, block_size)
    if weight.numel() == 0:
        return _empty_result(weight, block_size)
    if triton_path_available(weight):
        return _triton_quantize(weight, block_size)
    return torch_fp8_block(weight, block_size)


def kernel_configs(block_size: int) -> list[tuple[int, int]]:
    """The ``(tile_rows, num_warps)`` launch configurations the kernel supports for `block_size`.

    ``tile_rows ≥ block_size`` (blocks up to 128): one pass, the whole block in registers, so the
    input is read once. Smaller: two passes over ``tile_rows``-row slices of the block (the amax,
    then a re-read to quantize, from L2 while the block is still there), fewer registers per thread
    and more programs per SM. All give the same bits; the first is the default. For blocks of 128
    and more it is two passes over 32-row slices with 8 warps, the fastest measured on an H200
    (`bench/fp8_quant.py --device cuda`, bf16: 57 % / 56 % of the copy bandwidth for 7168×2048 /
    2048×7168 and 82 % for 64 such experts, against 50 % / 50 % / 70 % in one pass with 16 warps).
    Smaller blocks start with one pass over the whole block. The bench times them all.
    """
    full = 1 << (block_size - 1).bit_length()  # a power of two ≥ block_size
    warps = max(1, min(16, full * full // 1024))  # 16 for a 128×128 tile: 32 elements per thread
    configs = [(full, warps), (full, max(1, warps // 2))] if full <= _MAX_TILE else []
    configs += [(min(16, full), 4), (min(8, full), 4), (min(32, full), 4), (min(32, full), 8)]
    if full >= _MAX_TILE:
        configs.insert(0, (32, 8))
    return list(dict.fromkeys(configs))


def _triton_quantize(
    weight: torch.Tensor,
    block_size: int,
    *,
    cast_in_kernel: bool | None = None,
    config: tuple[int, int] | None = None,
    reciprocal: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel on `weight`'s device, whatever it is (CPU tensors need TRITON_INTERPRET=1).

    ``config`` is a ``(tile_rows, num_warps)`` of `kernel_configs` (default: its first).
    ``cast_in_kernel`` (default: True unless TRITON_INTERPRET is set) picks where fp32 → e4m3
    happens. True: in the kernel (Triton's native cast; the only mode used on a GPU). False: the
    kernel stores the fp32 quotients ``x / scale`` and torch casts them here. The interpreter
    needs False: its software fp32 → fp8 conversion (``_convert_float`` in
    ``triton/runtime/interpreter.py``, Triton 3.6–3.9) is not round-to-nearest-even (ties round
    up, and a rounding carry out of the mantissa is lost, e.g. 31.6 → 16 instead of 32).
    ``reciprocal`` (default: whether `weight` is on CUDA) computes ``scale`` as ModelOpt's result
    has it on that device: ``amax * fl(1/448)`` on CUDA, ``amax / 448`` on the CPU (module docstring).
    """
    _check(weight, block_size)
    tile_rows, num_warps = config if config is not None else kernel_configs(block_size)[0]
    if config is not None and config not in kernel_configs(block_size):
        raise ValueError(f"config must be one of {kernel_configs(block_size)}, got {config!r}")
    if cast_in_kernel is None:
        cast_in_kernel = not _interpreting()
    if reciprocal is None:
        reciprocal = weight.is_cuda
    kernel = _kernel()
    stack = weight if weight.dim() == 3 else weight.unsqueeze(0)
    if stack.stride(2) * block_size >= 2**31:  # in-block column offsets are 32-bit in the kernel
        stack = stack.contiguous()
    experts, rows, cols = stack.shape
    row_blocks, col_blocks = _cdiv(rows, block_size), _cdiv(cols, block_size)
    scale = torch.empty((experts, row_blocks, col_blocks), dtype=torch.float32, device=weight.device)
    out_dtype = torch.float8_e4m3fn if cast_in_kernel else torch.float32
    data = torch.empty((experts, rows, cols), dtype=out_dtype, device=weight.device)
    if stack.numel():
        # Triton launches on the current CUDA device: make it the weight's.
        other_gpu = weight.is_cuda and weight.device.index not in (None, torch.cuda.current_device())
        with torch.cuda.device(weight.device) if other_gpu else contextlib.nullcontext():
            kernel[(experts * row_blocks * col_blocks,)](
                stack,
                data,
                scale,
                rows,
                cols,
                stack.stride(0),
                stack.stride(1),
                stack.stride(2),
                row_blocks,
                col_blocks,
                INV_FP8_MAX,
                BLOCK=block_size,
                TILE_R=tile_rows,
                TILE_C=min(1 << (block_size - 1).bit_length(), _MAX_TILE),
                CAST=cast_in_kernel,
                RECIPROCAL=reciprocal,
                num_warps=num_warps,
            )
    if not cast_in_kernel:
        data = data.to(torch.float8_e4m3fn)
    if weight.dim() == 2:
        return data[0], scale[0]
    return data, scale


# triton.language, bound by `_kernel()` on first use. The names a kernel uses must be module
# globals, not closure variables: Triton's interpreter re-executes a kernel's source in its module's
# namespace.
tl: Any = None


@functools.cache
def _kernel() -> Callable:
    """Build the Triton kernel (imports triton; honours TRITON_INTERPRET as set at first call)."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_block_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        stride_e,
        stride_r,
        stride_c,
        row_blocks,
        col_blocks,
        inv_fp8_max,
        BLOCK: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        CAST: tl.constexpr,
        RECIPROCAL: tl.constexpr,
    ):
        # One program per (expert, row block, column block); column blocks vary fastest.
        pid = tl.program_id(0)
        cb = pid % col_blocks
        eb = pid // col_blocks
        rb = eb % row_blocks
        e = eb // row_blocks
        row0 = rb * BLOCK
        col0 = cb * BLOCK
        # 64-bit block origins; in-block offsets: 64-bit rows, 32-bit columns (keeps the column
        # contiguity that vectorized loads need; the caller guarantees TILE_C * stride_c < 2**31).
        x_blk = (
            x_ptr + e.to(tl.int64) * stride_e + row0.to(tl.int64) * stride_r + col0.to(tl.int64) * stride_c
        )
        q_blk = q_ptr + (e.to(tl.int64) * rows + row0) * cols + col0
        offs_r = tl.arange(0, TILE_R)
        offs_c = tl.arange(0, TILE_C)

        # The amax, as int32 bits of |x|: they order like the floats and NaN sorts above +Inf, so
        # the integer max is torch.amax's max |x| with NaN propagation (tl.max on floats drops NaN).
        if TILE_R >= BLOCK and TILE_C >= BLOCK:
            # One pass: the whole block is one register tile (read once, reduce, quantize, write).
            r = row0 + offs_r
            c = col0 + offs_c
            rmask = r < rows
            cmask = c < cols
            if TILE_R > BLOCK:  # a block size that is not a power of two
                rmask = rmask & (offs_r < BLOCK)
            if TILE_C > BLOCK:
                cmask = cmask & (offs_c < BLOCK)
            mask = rmask[:, None] & cmask[None, :]
            src = x_blk + offs_r.to(tl.int64)[:, None] * stride_r + (offs_c * stride_c)[None, :]
            x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
            if RECIPROCAL:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
                scale = amax * inv_fp8_max
            else:
                scale = tl.math.div_rn(amax, 448.0)
            zero = scale == 0.0
            q = tl.where(zero, 0.0, tl.math.div_rn(x, tl.where(zero, 1.0, scale)))
            dst = q_blk + offs_r.to(tl.int64)[:, None] * cols + offs_c[None, :]
            if CAST:
                tl.store(dst, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
            else:
                tl.store(dst, q, mask=mask)
        else:
            # Two passes over TILE_R × TILE_C slices: the amax (elementwise max, one reduction at
            # the end), then a re-read (mostly from L2) to quantize.
            acc = tl.zeros((TILE_R, TILE_C), dtype=tl.int32)
            for i in range(0, BLOCK, TILE_R):
                r = row0 + i + offs_r
                rmask = r < rows
                if BLOCK % TILE_R != 0:
                    rmask = rmask & ((i + offs_r) < BLOCK)
                for j in range(0, BLOCK, TILE_C):
                    c = col0 + j + offs_c
                    cmask = c < cols
                    if BLOCK % TILE_C != 0:
                        cmask = cmask & ((j + offs_c) < BLOCK)
                    mask = rmask[:, None] & cmask[None, :]
                    src = (
                        x_blk
                        + (i + offs_r).to(tl.int64)[:, None] * stride_r
                        + ((j + offs_c) * stride_c)[None, :]
                    )
                    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                    acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
            amax = tl.max(acc).to(tl.float32, bitcast=True)
            if RECIPROCAL:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
                scale = amax * inv_fp8_max
            else:
                scale = tl.math.div_rn(amax, 448.0)
            zero = scale == 0.0
            divisor = tl.where(zero, 1.0, scale)
            for i in range(0, BLOCK, TILE_R):
                r = row0 + i + offs_r
                rmask = r < rows
                if BLOCK % TILE_R != 0:
                    rmask = rmask & ((i + offs_r) < BLOCK)
                for j in range(0, BLOCK, TILE_C):
                    c = col0 + j + offs_c
                    cmask = c < cols
                    if BLOCK % TILE_C != 0:
                        cmask = cmask & ((j + offs_c) < BLOCK)
                    mask = rmask[:, None] & cmask[None, :]
                    src = (
                        x_blk
                        + (i + offs_r).to(tl.int64)[:, None] * stride_r
                        + ((j + offs_c) * stride_c)[None, :]
                    )
                    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                    q = tl.where(zero, 0.0, tl.math.div_rn(x, divisor))
                    dst = q_blk + (i + offs_r).to(tl.int64)[:, None] * cols + (j + offs_c)[None, :]
                    if CAST:
                        tl.store(dst, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
                    else:
                        tl.store(dst, q, mask=mask)
        tl.store(s_ptr + pid, scale)

    return fp8_block_kernel
