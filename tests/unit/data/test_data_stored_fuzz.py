"""Fuzz of stored bytes: flip, truncate or overwrite random bytes of a shard file or the manifest.
Reading then either yields batches that pass ``validate`` or raises ``ShardError`` naming a file
of the folder; never another exception type."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.data import validate
from moe_rl.data.errors import ShardError
from moe_rl.data.shards import MANIFEST_NAME, read_shards, write_shards
from moe_rl.data.synthetic import random_batch

VOCAB, TOPK, EXPERTS = 32, 2, 8
LIMITS = {"vocab_size": VOCAB, "num_experts": EXPERTS, "topk": TOPK}
TARGETS = (MANIFEST_NAME, "shard-00000.arrow", "shard-00001.arrow")


def _corrupt(data: bytearray, edit: str, draw: st.DataObject) -> bytearray:
    if edit == "truncate":
        return data[: draw.draw(st.integers(0, len(data) - 1), label="keep")]
    at = draw.draw(st.integers(0, len(data) - 1), label="at")
    if edit == "flip":
        data[at] ^= 1 << draw.draw(st.integers(0, 7), label="bit")
    else:
        new = draw.draw(st.binary(min_size=1, max_size=16), label="bytes")
        data[at : at + len(new)] = new[: len(data) - at]
    return data


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    compression=st.sampled_from([None, "zstd", "lz4"]),
    target=st.sampled_from(TARGETS),
    edit=st.sampled_from(["flip", "truncate", "overwrite"]),
    draw=st.data(),
)
def test_corrupted_bytes_read_as_valid_data_or_one_shard_error(
    seed: int, compression: str | None, target: str, edit: str, draw: st.DataObject
) -> None:
    batch = random_batch(
        seed, 3, vocab_size=VOCAB, routing=(2, TOPK, EXPERTS), sampling_mask=True, old_logp=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_shards(
            [batch], folder, max_samples_per_shard=2, samples_per_record_batch=1,
            compression=compression, include_old_logp=True,
        )  # fmt: skip
        path = folder / target
        path.write_bytes(bytes(_corrupt(bytearray(path.read_bytes()), edit, draw)))
        try:
            restored = list(read_shards(folder, **LIMITS))
        except ShardError as err:
            assert err.path.startswith(str(folder)), str(err)
            assert str(err).startswith(err.path + ": ")
            return
    for piece in restored:
        validate(piece, **LIMITS)
