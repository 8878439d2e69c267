"""Compact routing traces (rollout routing replay, R3) and their lossless disk codec.

A routing trace holds, for every token the engine ran a forward on and every MoE layer, the top-k
expert ids the engine's router picked: ``topk_idx_TLK`` of shape ``[tokens, layers, k]``.
Engines hand it over as int16/int32/int64; we store it as uint8 when ``num_experts <= 256`` and
as uint16 when ``num_experts <= 65536``, which is 1/4 (or 1/2) of int32 and exact.

The order of ids inside a token's top-k is kept as given (it is the router's order); nothing
here sorts it. ``encode_routing`` / ``decode_routing`` add an optional lossless compressor for
disk or the wire (zstd or lz4 through pyarrow, zlib or lzma from the standard library); the
layer-major layout puts the ids of one layer next to each other, where expert popularity is
skewed, which lets the compressor find more redundancy. Torch supports uint16 only in part
(indexing, cat, ``.to`` work; comparisons do not): convert with ``.long()`` before math.
"""

from __future__ import annotations

import lzma
import struct
import zlib

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from moe_rl.data.errors import TrajectoryError

MAX_EXPERTS = 1 << 16
CODECS = ("none", "zstd", "lz4", "zlib", "lzma")
_MAGIC = b"MRRT"
_HEADER = struct.Struct("<4sBBBBqII")  # magic, format, dtype, codec, flags, tokens, layers, k
_FORMAT_VERSION = 1
_DTYPE_CODES = {torch.uint8: 1, torch.uint16: 2}
_NP_DTYPES = {torch.uint8: np.uint8, torch.uint16: np.uint16}


def compact_dtype(num_experts: int) -> torch.dtype:
    """uint8 for ``num_experts <= 256``, uint16 for ``<= 65536``; anything else is an error."""
    if not 0 < num_experts <= MAX_EXPERTS:
        raise TrajectoryError(
            "num_experts",
            "cannot store expert ids compactly",
            value=num_experts,
            expected=f"1..{MAX_EXPERTS}",
        )
    return torch.uint8 if num_experts <= 256 else torch.uint16


def compact_routing(
    topk_idx_TLK: np.ndarray | Tensor, num_experts: int, *, sample: int | None = None
) -> Tensor:
    """Integer ``[tokens, layers, k]`` expert ids -> compact uint8/uint16 tensor, order kept.

    Raises ``TrajectoryError`` (field ``routed_experts``, naming ``sample`` when given) for
    non-integer input, a wrong number of dimensions, or ids outside ``[0, num_experts)`` — never
    wraps around silently.
    """
    if isinstance(topk_idx_TLK, Tensor) and topk_idx_TLK.device.type != "cpu":
        raise TrajectoryError(
            "routed_experts",
            "trajectory tensors live on the CPU",
            sample=sample,
            value=str(topk_idx_TLK.device),
        )
    arr = topk_idx_TLK.numpy() if isinstance(topk_idx_TLK, Tensor) else np.asarray(topk_idx_TLK)
    if arr.ndim != 3:
        raise TrajectoryError(
            "routed_experts",
            "wrong shape",
            sample=sample,
            value=tuple(arr.shape),
            expected="[tokens, layers, k]",
        )
    if arr.dtype.kind not in "iu":
        raise TrajectoryError(
            "routed_experts", "expert ids must be integers", sample=sample, value=str(arr.dtype)
        )
    dtype = compact_dtype(num_experts)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        token = int(np.argwhere(arr == bad)[0][0])
        raise TrajectoryError(
            "routed_experts",
            "expert id out of range",
            sample=sample,
            token=token,
            value=bad,
            expected=f"0..{num_experts - 1}",
        )
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype]).copy())


def encode_routing(
    compact: Tensor,
    *,
    codec: str = "zstd",
    layer_major: bool = True,
    split_bytes: bool = True,
    level: int | None = None,
) -> bytes:
    """Serialize a compact ``[tokens, layers, k]`` trace into self-describing bytes (lossless).

    ``layer_major`` stores ``[layers, tokens, k]``; ``split_bytes`` (uint16 only) stores all low
    bytes, then all high bytes, so the nearly constant high bytes compress to almost nothing.
    """
    if compact.dtype not in _DTYPE_CODES or compact.dim() != 3:
        raise TrajectoryError(
            "routed_experts",
            "expected a compact [tokens, layers, k] uint8/uint16 tensor",
            value=(str(compact.dtype), tuple(compact.shape)),
        )
    if codec not in CODECS:
        raise TrajectoryError("codec", "unknown routing codec", value=codec, expected=str(CODECS))
    arr = compact.numpy().astype(np.dtype(_NP_DTYPES[compact.dtype]).newbyteorder("<"), copy=False)
    if layer_major:
        arr = arr.transpose(1, 0, 2)
    split = split_bytes and compact.dtype == torch.uint16
    raw = np.ascontiguousarray(arr).view(np.uint8)
    raw = raw.reshape(-1, 2).T if split else raw
    flags = int(layer_major) | (int(split) << 1)
    num_tokens, num_layers, topk = compact.shape
    header = _HEADER.pack(
        _MAGIC,
        _FORMAT_VERSION,
        _DTYPE_CODES[compact.dtype],
        CODECS.index(codec),
        flags,
        num_tokens,
        num_layers,
        topk,
    )
    return header + _compress(np.ascontiguousarray(raw).tobytes(), codec, level)


def decode_routing(blob: bytes) -> Tensor:
    """Inverse of ``encode_routing``: the compact ``[tokens, layers, k]`` tensor, bit-exact."""
    magic, version, dtype_code, codec_code, flags, num_tokens, num_layers, topk = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _FORMAT_VERSION:
        raise TrajectoryError(
            "routed_experts",
            "not an encoded routing trace",
            value=(magic, version),
            expected=f"{_MAGIC!r} format {_FORMAT_VERSION}",
        )
    dtype = next(d for d, c in _DTYPE_CODES.items() if c == dtype_code)
    le_dtype = np.dtype(_NP_DTYPES[dtype]).newbyteorder("<")
    raw_size = num_tokens * num_layers * topk * le_dtype.itemsize
    raw = np.frombuffer(_decompress(memoryview(blob)[_HEADER.size :], CODECS[codec_code], raw_size), np.uint8)
    if flags & 2:
        raw = np.ascontiguousarray(raw.reshape(2, -1).T)
    layer_major = bool(flags & 1)
    shape = (num_layers, num_tokens, topk) if layer_major else (num_tokens, num_layers, topk)
    arr = raw.view(le_dtype).reshape(shape)
    if layer_major:
        arr = arr.transpose(1, 0, 2)
    return torch.from_numpy(np.array(arr, dtype=_NP_DTYPES[dtype], order="C", copy=True))


def _compress(raw: bytes, codec: str, level: int | None) -> bytes:
    if codec == "none":
        return raw
    if codec == "zlib":
        return zlib.compress(raw, 6 if level is None else level)
    if codec == "lzma":
        return lzma.compress(raw, preset=6 if level is None else level)
    return pa.Codec(codec, compression_level=level).compress(raw, asbytes=True)


def _decompress(payload: memoryview, codec: str, raw_size: int) -> bytes:
    if codec == "none":
        raw = bytes(payload)
    elif codec == "zlib":
        raw = zlib.decompress(payload)
    elif codec == "lzma":
        raw = lzma.decompress(payload)
    else:
        raw = pa.Codec(codec).decompress(payload, decompressed_size=raw_size, asbytes=True)
    if len(raw) != raw_size:
        raise TrajectoryError(
            "routed_experts",
            "decoded routing has the wrong size",
            value=len(raw),
            expected=f"{raw_size} bytes",
        )
    return raw
