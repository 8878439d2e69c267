"""The numerics of the rollout recipes whose quantized bytes travel (``fp8``, ``int8``): a weight to
its 8-bit data and fp32 scales per block (`quantize_fp8`, `quantize_int8`), the values an engine
computes with from them (`dequantize`), and the error a sync reports (`quant_errors`). The weight
sync applies them on the wire (`moe_rl.weight_sync.wire`).

``scale = amax / 448`` (e4m3) or ``amax / 127`` (int8) per block (the block of ``tensor`` granularity
is the whole tensor, of ``channel`` a row), ``data = q(x / scale)``; a block whose scale is 0 sends
zeros. Block FP8 comes from `moe_rl.quant.fp8_block.quantize_fp8_block` (a fused kernel on CUDA); on
CPU a large weight of whole blocks is encoded and decoded by the fused kernels of `moe_rl.quant.fused`.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from moe_rl.config.modes import Granularity, QuantMethod
from moe_rl.config.schema import QuantConfig
from moe_rl.quant import fused
from moe_rl.quant.recipes import FP8_E4M3_MAX

INT8_MAX = 127.0


def block_of(cfg: QuantConfig, shape: torch.Size) -> tuple[int, int]:
    if cfg.granularity == Granularity.BLOCK:
        return cfg.block_size, cfg.block_size
    if cfg.granularity == Granularity.CHANNEL:
        return 1, shape[1]
    return shape[0], shape[1]


def _block_amax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """``max |x|`` per ``block`` (partial blocks at the edges count their own elements)."""
    rows, cols = x.shape
    bo, bi = block
    pr, pc = -rows % bo, -cols % bi
    padded = torch.nn.functional.pad(x.abs(), (0, pc, 0, pr))
    return padded.view((rows + pr) // bo, bo, (cols + pc) // bi, bi).amax(dim=(1, 3))


def scale_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _expand(scale: Tensor, block: tuple[int, int], shape: torch.Size) -> Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def quantize_fp8(weight: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(e4m3 data, fp32 scales, block)`` of a 2-D weight under an fp8 recipe."""
    block = block_of(cfg, weight.shape)
    if cfg.granularity == Granularity.BLOCK:
        from moe_rl.quant.fp8_block import quantize_fp8_block

        data, scale = quantize_fp8_block(weight, cfg.block_size)
        return data, scale, block
    x = weight.float()
    scale = _block_amax(x, block) / FP8_E4M3_MAX
    full = _expand(scale, block, x.shape)
    data = torch.where(full > 0, x / full, torch.zeros_like(x)).to(torch.float8_e4m3fn)
    return data, scale, block


def quantize_int8(weight: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(int8 data, fp32 scales, block)`` of a 2-D weight: symmetric, ±127, per row or tensor."""
    block = (
        (1, weight.shape[1]) if cfg.granularity == Granularity.CHANNEL else (weight.shape[0], weight.shape[1])
    )
    x = weight.float()
    scale = _block_amax(x, block) / INT8_MAX
    full = _expand(scale, block, x.shape)
    q = torch.where(full > 0, x / full, torch.zeros_like(x)).round().clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale, block


def dequantize(
    data: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    out: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The values a quantized engine holds: ``data · scale`` blockwise, computed in float32 (the
    scales broadcast over their blocks, not expanded) and written into ``out`` (a floating tensor of
    ``data``'s shape and device, e.g. the engine's weight: the float32 values cast to its dtype) or
    into a new tensor of ``dtype`` (the same values as a float32 result cast to it).

    On CPU a large e4m3 weight of whole blocks is decoded by one fused kernel (`fused.decode`);
    otherwise this runs over `DECODE_CHUNK_ELEMENTS` at a time through a small scratch that stays in
    the caches, so the float32 values of a whole weight never exist and ``out`` is written once."""
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    elif tuple(out.shape) != tuple(data.shape) or not out.is_floating_point() or out.device != data.device:
        raise ValueError(
            f"cannot decode a {tuple(data.shape)} weight on {data.device} into a {out.dtype} "
            f"{tuple(out.shape)} tensor on {out.device}"
        )
    scale = scale.float()
    if data.numel() == 0:
        return out
    rows, cols = data.shape
    bo, bi = block
    row_block = torch.arange(rows, device=data.device) // bo
    if data.device.type != "cpu":  # one pass of whole-tensor ops on an accelerator
        out.copy_(_scaled_rows(data.float(), scale.index_select(0, row_block), bi))
        return out
    if (
        data.dtype == torch.float8_e4m3fn
        and fused.usable(data.shape, block, data.device)
        and fused.decode(data, scale, block, out)
    ):
        return out
    shifted = scale * E4M3_OFFSET
    bits = _e4m3_bits_decodable(data, shifted)
    factor = shifted if bits else scale
    step = max(1, DECODE_CHUNK_ELEMENTS // cols)
    in_place = out.dtype == torch.float32 and out.is_contiguous()
    scratch = None if in_place else _scratch(min(rows, step) * cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        values = out[start:stop] if in_place else scratch[: (stop - start) * cols].view(stop - start, cols)
        if bits:
            as_int = values.view(torch.int32)
            as_int.copy_(data[start:stop].view(torch.int8))  # sign-extended: the sign lands in bits 8..31
            as_int.bitwise_left_shift_(20).bitwise_and_(_F32_SIGN_AND_E4M3_BITS)
        else:
            values.copy_(data[start:stop])  # torch's conversion
        _scaled_rows(values, factor.index_select(0, row_block[start:stop]), bi)
        if not in_place:
            out[start:stop].copy_(values)
    return out


DECODE_CHUNK_ELEMENTS = 1 << 20
"""Elements a CPU decode works on at a time (4 MB of float32 scratch: cache-resident, so its
integer and scaling passes run at cache speed and only the result goes to memory)."""
_SCRATCH = threading.local()


def _scratch(elements: int) -> Tensor:
    """This thread's float32 decode scratch, at least ``elements`` long (kept from call to call)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < elements:
        buf = _SCRATCH.buf = torch.empty(elements, dtype=torch.float32)
    return buf


def _scaled_rows(values: Tensor, scales: Tensor, bi: int) -> Tensor:
    """``values`` (rows, cols) times ``scales`` (rows, column blocks), each over its ``bi`` columns
    (the last block may be partial), in place."""
    rows, cols = values.shape
    full = cols // bi
    if full:
        values[:, : full * bi].view(rows, full, bi).mul_(scales[:, :full, None])
    if full * bi < cols:
        values[:, full * bi :].mul_(scales[:, full:])
    return values


E4M3_OFFSET = 2.0**120
"""An e4m3 byte's sign, exponent and mantissa bits placed where float32 keeps them give its value
times ``2**-120`` (the exponent biases differ by 127 - 7), subnormals and zero included."""
_F32_SIGN_AND_E4M3_BITS = -(1 << 31) | 0x07F0_0000  # (int32) sign bit, then 4 + 3 bits from bit 20


def _e4m3_bits_decodable(data: Tensor, shifted_scale: Tensor) -> bool:
    """Whether ``data · scale`` may be computed from e4m3 bits placed into float32 bits (the power of
    two they are off by, `E4M3_OFFSET`, moved into the scale: ``shifted_scale`` = ``scale ·
    E4M3_OFFSET``, exact, only the exponent changes).
    torch converts e4m3 to float one element at a time on CPU (~0.15 G elements/s here); the bits
    take vectorized integer passes. Not when the moved offset overflows (a scale >= 2**8, or NaN)
    or a byte is e4m3's NaN (0x7F, 0xFF), which the bits would read as 480."""
    if data.dtype != torch.float8_e4m3fn:
        return False
    if not bool(torch.isfinite(shifted_scale).all()):
        return False
    return int(data.view(torch.int8).max()) != 0x7F and int(data.view(torch.uint8).max()) != 0xFF


ERROR_ROWS = 128
"""Rows per chunk when the sender measures the quantization error (bounded temporaries)."""


def quant_errors(
    original: Tensor, data: Tensor, scale: Tensor, block: tuple[int, int]
) -> tuple[float, float]:
    """``(Σ (dequantized − original)², Σ original²)``, chunk by chunk of whole row blocks."""
    step = max(block[0], ERROR_ROWS // block[0] * block[0])
    err = ref = 0.0
    for start in range(0, original.shape[0], step):
        rows = slice(start, start + step)
        first = start // block[0]
        part = dequantize(data[rows], scale[first : first + -(-data[rows].shape[0] // block[0])], block)
        x = original[rows].float().reshape(-1)  # (the weight itself when it is float32: read only)
        ref += float(torch.dot(x, x))
        diff = part.reshape(-1).sub_(x)
        err += float(torch.dot(diff, diff))
    return err, ref


def _fused(cfg: QuantConfig, tensor: Tensor) -> bool:
    """Whether ``tensor`` is block-FP8 encoded by the fused CPU kernel (`fused.encode_fp8_block`)."""
    return (
        cfg.method == QuantMethod.FP8
        and cfg.granularity == Granularity.BLOCK
        and fused.usable(tensor.shape, block_of(cfg, tensor.shape), tensor.device)
    )


def quantize_into(tensor: Tensor, cfg: QuantConfig, data: Tensor, scale: Tensor) -> tuple[float, float]:
    """Quantize ``tensor`` by the recipe ``cfg`` into ``data`` and ``scale`` (a bucket's views);
    ``(Σ error², Σ original²)`` of what the engine will hold."""
    block = block_of(cfg, tensor.shape)
    if _fused(cfg, tensor) and tensor.device == data.device:
        sums = fused.encode_fp8_block(tensor, cfg.block_size, data, scale)
        if sums is not None:
            return sums
    if (
        cfg.method == QuantMethod.FP8
        and cfg.granularity == Granularity.BLOCK
        and tensor.device == data.device
    ):
        from moe_rl.quant.fp8_block import torch_fp8_block

        torch_fp8_block(tensor, cfg.block_size, out=(data, scale))  # in place, row blocks at a time
        sent_data, sent_scale = data, scale
    else:  # computed on the tensor's device (the Triton kernel on CUDA), then copied in
        quantize = quantize_fp8 if cfg.method == QuantMethod.FP8 else quantize_int8
        sent_data, sent_scale, block = quantize(tensor, cfg)
        data.copy_(sent_data)
        scale.copy_(sent_scale)
    return quant_errors(tensor, sent_data, sent_scale, block)
