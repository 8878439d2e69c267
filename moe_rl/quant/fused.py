"""Fused CPU kernels for the FP8 wire: block-FP8 encoding (with the error sums the sync reports) and
decoding, each one compiled pass over the weight instead of a string of torch operations.

On CPU the torch-operation paths (`moe_rl.quant.fp8_block.torch_fp8_block` plus the sender's
error measure, `moe_rl.quant.codec.dequantize`) run each step as its own pass over the
weight or a chunk of it (torch converts e4m3 to float one element at a time, which the decode
works around with integer passes). Here each direction is one function compiled with
``torch.compile`` (Inductor's C++ backend, vectorized, on torch's threads): the decode reads each
e4m3 byte once and writes the weight once; the encode reads the weight a few times (block maxima,
quantization with the error sum, the norm) and writes the e4m3 bytes and scales, with no full-size
temporary. On 2 cores: decode ~4 G elements/s against ~1.3, encode with its error measure ~0.7-0.9
against ~0.3. Both give bit for bit what the torch-operation paths give, NaN payloads aside (a test
holds them to it); the error sums agree to float32 rounding.

They are used on CPU for weights of at least `FUSED_MIN_ELEMENTS` whose sides are whole blocks
(the block-FP8 layouts of large models); everything else keeps the torch operations, so a tiny
model never compiles anything. Each kernel sees the weight as (row blocks, block rows, column
blocks, block columns) and is compiled with dynamic sizes, so shapes do not each get their own
kernel (a few variants at most: output dtypes, views). The first call in a process compiles it:
~10-20 s and ~150 MB of compiler state the process keeps (Inductor keeps the kernels on disk, so
later processes compile faster). Where compiling fails (e.g. no C++ compiler on the machine), a
warning says so once and the process keeps the torch-operation paths.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch import Tensor

from moe_rl.quant.recipes import FP8_E4M3_MAX

log = logging.getLogger(__name__)

FUSED_MIN_ELEMENTS = 1 << 22
"""Smallest weight (elements) a fused kernel runs on: smaller ones cost little either way, and a
small model does not pay for compiling."""

_enabled = True
_FAILED = object()
"""What `_run` gives when the kernel could not be compiled."""


@contextlib.contextmanager
def turned_off() -> Iterator[None]:
    """Within the block, the torch-operation paths only (to compare against them)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


def usable(shape: tuple[int, ...] | torch.Size, block: tuple[int, int], device: torch.device) -> bool:
    """Whether a 2-D weight of ``shape`` with ``block`` scales goes through a fused kernel."""
    if not _enabled or device.type != "cpu" or len(shape) != 2:
        return False
    (rows, cols), (bo, bi) = shape, block
    return rows * cols >= FUSED_MIN_ELEMENTS and bo > 0 and bi > 0 and rows % bo == 0 and cols % bi == 0


def decode(data: Tensor, scale: Tensor, block: tuple[int, int], out: Tensor) -> bool:
    """``out = data · scale`` blockwise (float32 products cast to ``out``'s dtype). False when the
    kernel could not be compiled or the scales do not tile ``data`` (then nothing was written)."""
    if tuple(scale.shape) != (data.shape[0] // block[0], data.shape[1] // block[1]):
        return False
    return (
        _run(_decoder(), _blocks(data, block), _blocks(scale.float(), (1, 1)), _blocks(out, block))
        is not _FAILED
    )


def encode_fp8_block(
    weight: Tensor, block_size: int, data: Tensor, scale: Tensor
) -> tuple[float, float] | None:
    """Block-FP8 quantization of ``weight`` into ``data`` (e4m3) and ``scale`` (float32), with the
    zero-block rule, and ``(Σ (dequantized − weight)², Σ weight²)``; None when the kernel could not
    be compiled (then nothing was written)."""
    block = (block_size, block_size)
    sums = _run(_encoder(), _blocks(weight, block), _blocks(data, block), _blocks(scale, (1, 1)))
    return None if sums is _FAILED else (float(sums[0]), float(sums[1]))


def _blocks(x: Tensor, block: tuple[int, int]) -> Tensor:
    """A view of a 2-D tensor as (row blocks, rows of a block, column blocks, columns of a block):
    the kernels then index by strides alone, whatever the sizes (one kernel for every shape)."""
    (rows, cols), (bo, bi) = x.shape, block
    return x.view(rows // bo, bo, cols // bi, bi)


@functools.cache
def _decoder():
    def decode_blocks(data: Tensor, scale: Tensor, out: Tensor) -> None:
        out.copy_(data.float() * scale)

    return torch.compile(decode_blocks, dynamic=True)


@functools.cache
def _encoder():
    def encode_blocks(weight: Tensor, data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        x = weight.float()
        block_scale = x.abs().amax(dim=(1, 3), keepdim=True) / FP8_E4M3_MAX
        # a block whose scale is 0 sends zeros (the zero-block rule of `moe_rl.quant.fp8_block`)
        q = torch.where(block_scale == 0, 0.0, x / block_scale).to(torch.float8_e4m3fn)
        data.copy_(q)
        scale.copy_(block_scale)
        diff = q.float() * block_scale - x
        return (diff * diff).sum(), (x * x).sum()

    return torch.compile(encode_blocks, dynamic=True)


def _run(kernel, *args):
    global _enabled
    try:
        return kernel(*args)
    except Exception as err:  # compiling failed: keep the torch operations in this process
        _enabled = False
        log.warning(
            "fused CPU kernels for the FP8 wire are off in this process: compiling one failed (%s: %s); "
            "encoding and decoding run as torch operations (slower)",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return _FAILED
