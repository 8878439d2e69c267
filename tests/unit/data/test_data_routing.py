"""Compact routing codec: dtype choice, exact round trip, order kept, lossless compression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.data import TrajectoryError
from moe_rl.data.routing import (
    CODECS,
    compact_dtype,
    compact_routing,
    decode_routing,
    encode_routing,
)
from moe_rl.data.synthetic import skewed_routing


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [
        (1, torch.uint8),
        (128, torch.uint8),
        (256, torch.uint8),
        (257, torch.uint16),
        (384, torch.uint16),
        (65536, torch.uint16),
    ],
)
def test_compact_dtype_choice(num_experts: int, dtype: torch.dtype) -> None:
    assert compact_dtype(num_experts) == dtype


@pytest.mark.parametrize("num_experts", [0, -3, 65537])
def test_compact_dtype_rejects_impossible_counts(num_experts: int) -> None:
    with pytest.raises(TrajectoryError, match="num_experts"):
        compact_dtype(num_experts)


ROUND_TRIP_CASES = [
    pytest.param(e, d, id=f"{e}-experts-from-{np.dtype(d).name}")
    for e in (8, 256, 384, 65536)
    for d in (np.int16, np.int32, np.int64, np.uint16)
    if np.iinfo(d).max >= e - 1
]


@pytest.mark.parametrize(("num_experts", "src_dtype"), ROUND_TRIP_CASES)
def test_compact_round_trip_keeps_values_and_order(num_experts: int, src_dtype: type) -> None:
    rng = np.random.default_rng(num_experts)
    k = min(4, num_experts)
    ids = np.stack([rng.permutation(num_experts)[:k] for _ in range(30)]).reshape(10, 3, k)
    compact = compact_routing(ids.astype(src_dtype), num_experts)
    assert compact.dtype == compact_dtype(num_experts)
    assert compact.element_size() == (1 if num_experts <= 256 else 2)
    assert np.array_equal(compact.long().numpy(), ids)  # order within top-k unchanged


def test_compact_accepts_torch_input_and_descending_order() -> None:
    ids = torch.tensor([[[7, 3, 5]], [[0, 6, 1]]])
    assert compact_routing(ids, 8).tolist() == ids.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(np.full((2, 1, 2), 8), id="too-large"),
        pytest.param(np.full((2, 1, 2), -1), id="negative"),
    ],
)
def test_compact_rejects_out_of_range(bad: np.ndarray) -> None:
    with pytest.raises(TrajectoryError, match=r"routed_experts \(token 0\).*out of range"):
        compact_routing(bad, 8)


def test_compact_rejects_floats_and_wrong_rank() -> None:
    with pytest.raises(TrajectoryError, match="integers"):
        compact_routing(np.zeros((2, 1, 2), dtype=np.float32), 8)
    with pytest.raises(TrajectoryError, match="shape"):
        compact_routing(np.zeros((2, 2), dtype=np.int32), 8)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("layer_major", [True, False])
@pytest.mark.parametrize("split_bytes", [True, False])
@pytest.mark.parametrize("num_experts", [128, 384, 5000])
def test_encode_decode_is_bit_exact(
    codec: str, layer_major: bool, split_bytes: bool, num_experts: int
) -> None:
    compact = compact_routing(skewed_routing(50, 4, 8, num_experts, seed=1), num_experts)
    blob = encode_routing(compact, codec=codec, layer_major=layer_major, split_bytes=split_bytes)
    decoded = decode_routing(blob)
    assert decoded.dtype == compact.dtype and torch.equal(decoded, compact)


def test_encode_handles_empty_trace() -> None:
    empty = torch.zeros(0, 3, 2, dtype=torch.uint8)
    assert decode_routing(encode_routing(empty)).shape == (0, 3, 2)


def test_compression_shrinks_skewed_traces() -> None:
    compact = compact_routing(skewed_routing(512, 8, 8, 128, seed=2), 128)
    assert len(encode_routing(compact, codec="zstd")) < 0.8 * compact.numel()


def test_split_bytes_helps_uint16() -> None:
    compact = compact_routing(skewed_routing(512, 8, 8, 384, seed=2), 384)
    split, plain = (len(encode_routing(compact, split_bytes=s)) for s in (True, False))
    assert split < plain < compact.numel() * 2


def test_decode_rejects_foreign_bytes_and_unknown_codec() -> None:
    with pytest.raises(TrajectoryError, match="not an encoded routing trace"):
        decode_routing(b"XXXX" + bytes(40))
    with pytest.raises(TrajectoryError, match="codec"):
        encode_routing(torch.zeros(1, 1, 1, dtype=torch.uint8), codec="brotli9")
    with pytest.raises(TrajectoryError, match="routed_experts"):
        encode_routing(torch.zeros(1, 1, 1, dtype=torch.int32))


def test_skewed_routing_has_distinct_ids_and_skew() -> None:
    ids = skewed_routing(400, 2, 8, 64, seed=3)
    assert (np.sort(ids, -1)[..., 1:] != np.sort(ids, -1)[..., :-1]).all()
    counts = np.bincount(ids[:, 0].ravel(), minlength=64)
    assert counts.max() > 3 * counts.mean()
