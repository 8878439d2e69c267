"""A weight larger than a bucket travels in row chunks: no bucket and no sender buffer grows past
the bucket capacity, the receiver puts each weight back together (decoded, where quantized) into
exactly what a whole sync gives, the sync's quantization report counts each weight once, and
chunks that do not fit their weight are refused by name."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config.schema import QuantConfig
from moe_rl.weight_sync import shm
from moe_rl.weight_sync.buckets import SLACK, BucketPacker
from moe_rl.weight_sync.wire import Rejoin, WireEncoder, decode
from tests.unit.weight_sync.sync_testing import bucket_items, detach

CAPACITY = 256
RECIPES = [
    QuantConfig(name="fp8_block128", method="fp8", granularity="block", block_size=4),
    QuantConfig(name="int8", method="int8", granularity="channel"),
    QuantConfig(name="bf16", method="none"),
]


def _groups(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.layers.0.self_attn.q_proj.weight", torch.randn(30, 8, generator=g).bfloat16())],  # 30: not whole blocks
        [("model.layers.0.mlp.gate_proj.weight", torch.randn(40, 8, generator=g).bfloat16()),
         ("model.layers.0.mlp.up_proj.weight", torch.randn(40, 8, generator=g).bfloat16())],
        [("model.norm.weight", torch.randn(8, generator=g).bfloat16())],
        [("model.embed_tokens.weight", torch.randn(50, 8, generator=g))],  # 1600 B, never quantized
    ]  # fmt: skip


def _sync(cfg: QuantConfig, capacity: int | None, slots=None):
    """(buckets, decoded values, encoder, packer) of one sync at ``capacity`` (None: whole groups)."""
    encoder = WireEncoder(cfg, num_layers=1)
    packer = BucketPacker(capacity or 1 << 20, slots=slots)
    buckets = [
        detach(b) for b in packer.pack(lazy for g in _groups() for lazy in encoder.lazy_groups(g, capacity))
    ]
    rejoin = Rejoin()
    values = [item for b in buckets for item in decode(bucket_items(b), rejoin=rejoin)]
    rejoin.finish()
    return buckets, values, encoder, packer


@pytest.mark.parametrize("slotted", [False, True], ids=["buffer", "slot"])
@pytest.mark.parametrize("cfg", RECIPES, ids=lambda c: c.name)
def test_large_weights_travel_in_chunks_and_arrive_whole(cfg, slotted, tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    slots = shm.SharedSlots(CAPACITY, tag="chunks") if slotted else None
    buckets, values, encoder, packer = _sync(cfg, CAPACITY, slots)
    _, whole_values, whole_encoder, _ = _sync(cfg, None)

    chunks = [e for b in buckets for e in b.entries if "rows" in e.meta]
    assert {e.name for e in chunks} >= {"model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight"}
    assert all(b.nbytes <= CAPACITY for b in buckets)  # no bucket grows for a large weight
    held = slots.nbytes() if slots is not None else sum(b.nbytes for b in packer.buffers)
    assert held <= (2 if slotted else 1) * (CAPACITY + SLACK)  # nor does the sender's memory
    # each weight handed on once, whole, equal to what the whole sync decodes
    assert [n for n, _ in values] == [n for n, _ in whole_values]
    for (name, got), (_, want) in zip(values, whole_values, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    report, whole = encoder.report, whole_encoder.report
    assert (report.num_quantized, report.num_kept, report.bytes_sent) == (
        whole.num_quantized, whole.num_kept, whole.bytes_sent,
    )  # fmt: skip
    assert report.per_tensor.keys() == whole.per_tensor.keys()
    for name, rel in whole.per_tensor.items():
        assert report.per_tensor[name] == pytest.approx(rel, rel=1e-5), name
    if slots is not None:
        slots.close()


def test_chunks_land_in_the_tensor_the_receiver_gives():
    cfg = RECIPES[0]
    encoder = WireEncoder(cfg, num_layers=1)
    buckets = [detach(b) for b in BucketPacker(CAPACITY).pack(
        lazy for g in _groups() for lazy in encoder.lazy_groups(g, CAPACITY)
    )]  # fmt: skip
    _, whole_values, _, _ = _sync(cfg, None)
    weights = {name: torch.zeros(value.shape, dtype=torch.bfloat16) for name, value in whole_values}
    rejoin = Rejoin()
    landed = {}
    for bucket in buckets:
        for name, value in decode(bucket_items(bucket), into=weights.get, rejoin=rejoin):
            landed[name] = value
    rejoin.finish()
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert landed[gate] is weights[gate]  # decoded chunk by chunk straight into the weight
    assert torch.equal(weights[gate], dict(whole_values)[gate].bfloat16())
    embed = "model.embed_tokens.weight"  # not quantized: copied chunk by chunk into the weight
    assert landed[embed] is weights[embed] and torch.equal(
        weights[embed], dict(whole_values)[embed].bfloat16()
    )


def test_chunks_that_do_not_fit_their_weight_are_refused():
    buckets, _, _, _ = _sync(RECIPES[2], CAPACITY)
    chunked = [b for b in buckets if any(e.name == "model.embed_tokens.weight" for e in b.entries)]
    first, rest = chunked[0], chunked[1:]
    assert rest  # the embedding travels in several buckets

    with pytest.raises(ValueError, match="arrived in row chunks, but this receiver keeps no Rejoin"):
        list(decode(bucket_items(first)))
    rejoin = Rejoin()
    list(decode(bucket_items(first), rejoin=rejoin))
    with pytest.raises(
        ValueError, match=r"'model.embed_tokens.weight': rows 0:\d+ arrived twice in one sync"
    ):
        list(decode(bucket_items(first), rejoin=rejoin))
    with pytest.raises(ValueError, match=r"weight sync incomplete: 1 tensor\(s\) arrived in part, e.g. "
                                         r"'model.embed_tokens.weight': rows \[\(0, \d+\)\] of 50"):  # fmt: skip
        rejoin.finish()

    (name, chunk, meta), *_ = bucket_items(rest[0])
    with pytest.raises(
        ValueError, match=r"'model.embed_tokens.weight' arrived as rows 48:60 .* whole shape \(50, 8\)"
    ):
        list(decode([(name, chunk, {**meta, "rows": [48, 60]})], rejoin=Rejoin()))
    with pytest.raises(ValueError, match=r"arrives in chunks of a \(50, 8\) tensor, but the tensor it loads into "
                                         r"has shape \(49, 8\)"):  # fmt: skip
        list(decode([(name, chunk, meta)], into=lambda _: torch.zeros(49, 8), rejoin=Rejoin()))

    fp8, _, _, _ = _sync(RECIPES[0], CAPACITY)
    data = [(n, t, m) for b in fp8 for n, t, m in bucket_items(b) if "rows" in m and "block" in m]
    with pytest.raises(ValueError, match=r"\(rows \[0, \d+\]\) arrived quantized without its scales"):
        list(decode(data[:1], rejoin=Rejoin()))
