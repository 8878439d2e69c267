"""Buckets pack whole groups and give the bytes back; the wire carries a recipe's quantized bytes
and decodes them to the values a quantized engine holds."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config.schema import QuantConfig
from moe_rl.quant import codec
from moe_rl.quant.codec import dequantize, quant_errors, quantize_fp8, quantize_int8
from moe_rl.quant.fp8_block import quantize_fp8_block
from moe_rl.weight_sync.buckets import BucketPacker
from moe_rl.weight_sync.wire import WireEncoder, decode, scale_name
from tests.unit.weight_sync.sync_testing import bucket_items, detach, encode, lazy

FP8_BLOCK = QuantConfig(name="fp8_block128", method="fp8", granularity="block", block_size=4)


def _groups(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 6, generator=g))],
        [("model.layers.0.mlp.gate_proj.weight", torch.randn(5, 6, generator=g)),
         ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 6, generator=g))],
        [("model.norm.weight", torch.randn(6, generator=g).bfloat16())],
        [("model.embed_tokens.weight", torch.randn(40, 6, generator=g))],
    ]  # fmt: skip


def test_buckets_keep_groups_whole_and_bytes_exact():
    groups = [[(n, t, {}) for n, t in g] for g in _groups()]
    buckets = [detach(b) for b in BucketPacker(300, sender=3).pack(lazy(groups))]
    names = [[e.name for e in b.entries] for b in buckets]
    assert names == [
        ["model.layers.0.self_attn.q_proj.weight"],  # 192 B; the next group (240 B) does not fit
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
        ["model.embed_tokens.weight"],  # 960 B > capacity: a bucket of its own
    ]
    assert [b.index for b in buckets] == [0, 1, 2] and {b.sender for b in buckets} == {3}
    assert [b.nbytes for b in buckets] == [192, 252, 960]
    got = {e.name: t for b in buckets for e, t in b.tensors()}
    for name, tensor, _ in (item for g in groups for item in g):
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


@pytest.mark.parametrize("slotted", [False, True], ids=["buffer", "slot"])
def test_tensors_of_any_dtype_line_up_after_odd_sized_ones(slotted, tmp_path, monkeypatch):
    """An e4m3 weight of an odd number of bytes is followed by its float32 scales: every written
    tensor starts at an aligned offset, so each is viewed back in its dtype (and the padding is 0)."""
    from moe_rl.weight_sync import shm
    from moe_rl.weight_sync.buckets import ALIGN, BucketPacker

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    weights = [
        (f"model.layers.0.mlp.experts.{i}.down_proj.weight", torch.randn(5, 3).bfloat16()) for i in range(3)
    ]
    encoder = WireEncoder(FP8_BLOCK, num_layers=1)
    slots = shm.SharedSlots(4096, tag="align") if slotted else None
    buckets = list(BucketPacker(4096, slots=slots).pack(encoder.lazy_group([w]) for w in weights))
    entries = [e for b in buckets for e in b.entries]
    assert [e.nbytes for e in entries] == [15, 8] * 3  # 5x3 e4m3, then 2x1 float32 scales
    assert all(e.offset % ALIGN == 0 for e in entries)
    got = dict(decode(item for b in buckets for item in bucket_items(b)))
    for name, weight in weights:
        data, scale = quantize_fp8_block(weight, 4)
        assert torch.equal(got[name], dequantize(data, scale, (4, 4)))
    raw = buckets[0].data
    assert not raw[15:ALIGN].any() and not detach(buckets[0]).data[15:ALIGN].any()
    if slots is not None:
        slots.close()


def test_a_bucket_is_valid_until_the_next_is_requested():
    groups = [[(f"w{i}", torch.full((4,), float(i)), {})] for i in range(3)]
    stream = BucketPacker(16).pack(lazy(groups))
    first = next(stream)
    kept = detach(first)
    next(stream)  # reuses the working buffer
    assert dict((e.name, t) for e, t in kept.tensors())["w0"].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="capacity=0"):
        next(BucketPacker(0).pack(lazy(groups)))


def test_fp8_block_wire_is_e4m3_plus_scales_and_decodes_to_the_dequantized_weight():
    weight = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).bfloat16()
    encoder = WireEncoder(FP8_BLOCK, num_layers=2)
    items = encode(encoder, "model.layers.1.self_attn.o_proj.weight", weight)
    (name, data, meta), (sname, scale, smeta) = items
    assert meta == {"block": [4, 4], "scale": sname} and smeta == {"scale_of": name}
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert sname == scale_name(name) == "model.layers.1.self_attn.o_proj.weight_scale_inv"
    ref_data, ref_scale = quantize_fp8_block(weight, 4)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scale, ref_scale)
    ((out_name, values),) = list(decode(items))
    block = ref_scale.repeat_interleave(4, 0).repeat_interleave(4, 1)[:8, :6]
    assert out_name == name and torch.equal(values, ref_data.float() * block)
    assert 0 < encoder.report.rel_err < 0.1 and encoder.report.num_quantized == 1


def test_excluded_and_non_wire_recipes_travel_as_they_are():
    encoder = WireEncoder(FP8_BLOCK, num_layers=2)
    router = torch.randn(4, 6)
    ((name, sent, meta),) = encode(encoder, "model.layers.0.mlp.gate.weight", router)
    assert (name, meta) == ("model.layers.0.mlp.gate.weight", {}) and _as_it_lies(sent, router)
    awq = WireEncoder(QuantConfig(name="int4_awq", method="int4_awq", granularity="block"), num_layers=2)
    weight = torch.randn(8, 6)
    assert _as_it_lies(encode(awq, "model.layers.0.mlp.down_proj.weight", weight)[0][1], weight)
    off = WireEncoder(FP8_BLOCK, num_layers=2, quantized_wire=False)  # an engine that quantizes itself
    assert _as_it_lies(encode(off, "model.layers.0.mlp.down_proj.weight", weight)[0][1], weight)


def _as_it_lies(sent: torch.Tensor, tensor: torch.Tensor) -> bool:
    """``sent`` is ``tensor`` itself, carried where it lies (not copied into the bucket)."""
    return sent.data_ptr() == tensor.data_ptr() and torch.equal(sent, tensor)


@pytest.mark.parametrize("scale", [1.0, 3.7e-3, 1e-30, 255.0, 256.0, float("nan")])
@pytest.mark.parametrize("with_nan_bytes", [False, True])
def test_e4m3_decodes_bit_for_bit_as_torch_converts(scale, with_nan_bytes):
    """Every e4m3 byte (subnormals, zeros, both signs; NaN codes when present) times a scale, from
    tiny (subnormal products) to one whose power-of-two offset would overflow, equals torch's
    conversion times that scale, and blocks keep their own scales."""
    codes = torch.arange(256, dtype=torch.uint8)
    if not with_nan_bytes:
        codes = codes[(codes & 0x7F) != 0x7F]
    data = codes.repeat(2)[:504].reshape(12, 42).view(torch.float8_e4m3fn)
    scales = torch.full((4, 14), scale)
    scales[0, 0] = 0.5  # blocks of 3x3 with their own scales
    want = data.float() * scales.repeat_interleave(3, 0).repeat_interleave(3, 1)
    got = dequantize(data, scales, (3, 3))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    empty = torch.empty(0, 4, dtype=torch.float8_e4m3fn)
    assert dequantize(empty, torch.empty(0, 1), (3, 4)).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_chunk_by_chunk_into_a_weight_equals_decoding_it_whole(monkeypatch, dtype):
    """A CPU decode runs a few rows at a time through a scratch: rows of one block split over
    chunks, chunks spanning blocks, a partial last block either way and a NaN byte in a later chunk
    give what the whole-tensor computation gives, cast to the weight's dtype, written into it (or
    into a strided view of it); a weight of another shape is refused by name."""
    monkeypatch.setattr(codec, "DECODE_CHUNK_ELEMENTS", 3 * 42)  # 3 rows of 42 per chunk
    codes = torch.arange(256, dtype=torch.uint8)
    data = codes[(codes & 0x7F) != 0x7F].repeat(3)[: 11 * 42].reshape(11, 42)
    scales = torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) + 0.1  # 4x9 blocks
    for nan in (False, True):
        if nan:
            data[7, 40] = 0xFF
        e4m3 = data.view(torch.float8_e4m3fn)
        want = (e4m3.float() * scales.repeat_interleave(4, 0).repeat_interleave(9, 1)[:11, :42]).to(dtype)
        weight = torch.zeros(11, 50, dtype=dtype)
        got = dequantize(e4m3, scales, (4, 9), out=weight[:, 3:45])
        assert got.data_ptr() == weight[:, 3:45].data_ptr()
        assert torch.equal(weight[:, 3:45].nan_to_num(), want.nan_to_num())
        assert int(weight[:, 3:45].isnan().sum()) == int(nan) and not weight[:, :3].any()
        assert torch.equal(dequantize(e4m3, scales, (4, 9)).to(dtype).nan_to_num(), want.nan_to_num())
    items = encode(
        WireEncoder(FP8_BLOCK, num_layers=2), "model.layers.0.mlp.down_proj.weight", torch.randn(8, 8)
    )
    target = torch.empty(8, 8, dtype=torch.bfloat16)
    assert dict(decode(items, into={items[0][0]: target}.get))[items[0][0]] is target
    # a weight with nowhere to decode into is decoded to the dtype of the weight it loads into
    as_bf16 = dict(decode(items, into=lambda name: None, dtypes={items[0][0]: torch.bfloat16}))[items[0][0]]
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(
        as_bf16, dict(decode(items))[items[0][0]].bfloat16()
    )
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.down_proj.weight' arrived with shape \(8, 8\)"
    ):
        list(decode(items, into=lambda name: torch.empty(8, 4)))


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_tensor_and_channel_and_int8(granularity):
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
    weight[2] = 0  # a zero row: scale 0 sends zeros, never NaN
    cfg = QuantConfig(name="x", method="fp8", granularity=granularity)
    items = encode(WireEncoder(cfg, num_layers=1), "model.layers.0.mlp.down_proj.weight", weight)
    values = dict(decode(items))["model.layers.0.mlp.down_proj.weight"]
    assert torch.isfinite(values).all() and (values[2] == 0).all()
    assert items[1][1].shape == ((6, 1) if granularity == "channel" else (1, 1))
    assert (values - weight).norm() / weight.norm() < 0.08
    data, scale, block = quantize_int8(
        weight, QuantConfig(name="int8", method="int8", granularity=granularity)
    )
    assert data.dtype == torch.int8 and int(data.abs().max()) == 127
    assert (dequantize(data, scale, block) - weight).norm() / weight.norm() < 0.02


def test_a_quantized_weight_without_its_scales_is_an_error():
    items = encode(
        WireEncoder(FP8_BLOCK, num_layers=2), "model.layers.0.mlp.down_proj.weight", torch.randn(8, 8)
    )
    with pytest.raises(ValueError, match="without its scales"):
        list(decode(items[:1]))


@pytest.mark.parametrize(
    "cfg",
    [
        FP8_BLOCK,
        QuantConfig(name="fp8_tensor", method="fp8", granularity="tensor"),
        QuantConfig(name="int8", method="int8", granularity="channel"),
        QuantConfig(name="bf16", method="none"),
    ],
    ids=lambda c: c.name,
)
def test_what_the_sender_writes_into_the_bucket_is_the_recipes_quantization(cfg):
    """Groups written straight into buckets by the packer carry each weight quantized as the recipe's
    reference quantization gives it (its data and scales), or as it is, and the sync's report has
    each weight's error once."""
    groups = [[(n, t.bfloat16() if t.dim() == 2 else t) for n, t in g] for g in _groups(1)]
    groups[1][0][1][:4] = 0  # zero blocks
    encoder = WireEncoder(cfg, num_layers=2)
    buckets = [detach(b) for b in BucketPacker(200).pack(encoder.lazy_group(g) for g in groups)]
    got = {entry.name: value for b in buckets for entry, value in b.tensors()}
    err = ref = 0.0
    for name, tensor in (item for g in groups for item in g):
        if cfg.method == "none" or tensor.dim() != 2 or "embed_tokens" in name:
            assert torch.equal(got[name], tensor), name
            continue
        quantize = quantize_fp8 if cfg.method == "fp8" else quantize_int8
        data, scale, block = quantize(tensor, cfg)
        assert torch.equal(got[name].view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(got[scale_name(name)], scale), name
        e, r = quant_errors(tensor, data, scale, block)
        err, ref = err + e, ref + r
    quantized = sum(1 for g in groups for n, t in g if t.dim() == 2 and "embed_tokens" not in n)
    assert encoder.report.num_quantized == (0 if cfg.method == "none" else quantized)
    assert encoder.report.err_sq == pytest.approx(err, rel=1e-6)


def test_torch_fp8_block_out_must_fit():
    from moe_rl.quant.fp8_block import torch_fp8_block

    weight = torch.randn(8, 8)
    with pytest.raises(ValueError, match="out= must be float8_e4m3fn"):
        torch_fp8_block(weight, 4, out=(torch.empty(8, 8, dtype=torch.float8_e4m3fn), torch.empty(3, 2)))


def test_copy_into_copies_bytes_of_any_layout():
    from moe_rl.device import copy_into

    src = torch.randn(6, 8).bfloat16()
    out = torch.empty(6, 8, dtype=torch.bfloat16)
    copy_into(out, src)  # contiguous, one dtype: a byte copy
    assert torch.equal(out, src)
    out = torch.empty(8, 6, dtype=torch.bfloat16)
    copy_into(out, src.t())  # a transposed view: torch's copy
    assert torch.equal(out, src.t())
    out32 = torch.empty(6, 8)
    copy_into(out32, src)  # another dtype: torch's cast
    assert torch.equal(out32, src.float())


def test_without_slots_contiguous_cpu_tensors_travel_as_they_lie_out_of_band():
    import pickle

    from moe_rl.weight_sync.buckets import BucketPacker
    from moe_rl.weight_sync.wire import LazyGroup, Piece

    held = torch.arange(64, dtype=torch.bfloat16)  # contiguous: carried as it lies
    square = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    computed = torch.full((4,), 3.0)

    def fill(views):
        assert views[0] is None
        views[1].copy_(square.t())
        views[2].copy_(computed)

    group = LazyGroup(
        [
            Piece("held", held.dtype, (64,), {}, held),
            Piece("transposed", torch.float32, (4, 4), {}, square.t()),  # not contiguous: written
            Piece("computed", torch.float32, (4,), {}),
        ],
        fill,
    )
    (bucket,) = BucketPacker(1024).pack(iter([group]))
    assert [e.array for e in bucket.entries] == [0, None, None]
    assert bucket.buffer.nbytes == 128 and bucket.nbytes == 208  # only the written bytes (64 + 16, aligned)
    assert bucket.arrays[0].data_ptr() == held.data_ptr()  # no copy on the sender before publishing
    assert held.untyped_storage().resizable()  # a torch view until pickled: it may still leave memory
    out_of_band: list = []
    wire = pickle.dumps(bucket, protocol=5, buffer_callback=out_of_band.append)  # as Ray serializes
    assert len(out_of_band) == 2 and len(wire) < 1024  # the buffer and the held tensor, not in the pickle
    got = {e.name: t.clone() for e, t in pickle.loads(wire, buffers=out_of_band).tensors()}
    assert torch.equal(got["held"], held) and torch.equal(got["transposed"], square.t())
    assert torch.equal(got["computed"], computed)
    kept = detach(bucket)
    held.add_(1)
    assert torch.equal(dict((e.name, t) for e, t in kept.tensors())["held"], held - 1)
