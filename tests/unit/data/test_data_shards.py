"""On-disk shards: bit-exact round trip, streaming, manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_rl.data import TrajectoryBatch, TrajectoryError, first_difference, validate
from moe_rl.data.shards import MANIFEST_NAME, read_manifest, read_shards, write_shards
from moe_rl.data.synthetic import random_batch


def _batches() -> list[TrajectoryBatch]:
    return [random_batch(seed, 5, routing=(3, 2, 16), sampling_mask=True, old_logp=True) for seed in range(3)]


@pytest.mark.parametrize("compression", ["zstd", "lz4", None])
def test_round_trip_is_bit_exact_across_shards(tmp_path: Path, compression: str | None) -> None:
    batches = [b.replace(policy_version=7) for b in _batches()]
    manifest = write_shards(
        batches,
        tmp_path,
        max_samples_per_shard=4,
        samples_per_record_batch=3,
        compression=compression,
        include_old_logp=True,
        metadata={"step": 12},
    )
    assert [s.num_samples for s in manifest.shards] == [4, 4, 4, 3]
    assert [s.num_record_batches for s in manifest.shards] == [2, 2, 2, 1]
    chunks = list(read_shards(tmp_path))
    assert [c.num_samples for c in chunks] == [3, 1, 3, 1, 3, 1, 3]
    restored = TrajectoryBatch.concat(chunks)
    validate(restored)
    assert first_difference(restored, TrajectoryBatch.concat(batches)) is None
    on_disk = read_manifest(tmp_path)
    assert on_disk == manifest and on_disk.metadata == {"step": 12}
    body = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert body["num_samples"] == 15 and body["schema_version"] == 1
    assert body["num_response_tokens"] == restored.num_response_tokens


def test_old_logp_is_not_stored_by_default(tmp_path: Path) -> None:
    batch = _batches()[0]
    write_shards([batch], tmp_path, max_samples_per_shard=10)
    (restored,) = read_shards(tmp_path)
    assert restored.old_logp is None
    assert first_difference(restored, batch.replace(old_logp=None)) is None


def test_metadata_change_starts_a_new_shard(tmp_path: Path) -> None:
    a, b = _batches()[:2]
    manifest = write_shards(
        [a.replace(policy_version=8), b.replace(policy_version=9)], tmp_path, max_samples_per_shard=100
    )
    assert [(s.num_samples, s.policy_version) for s in manifest.shards] == [(5, 8), (5, 9)]
    versions = [c.policy_version for c in read_shards(tmp_path)]
    assert versions == [8, 9]


def test_round_trip_without_optional_fields_and_with_uint16_routing(tmp_path: Path) -> None:
    plain = random_batch(11, 6)
    wide = random_batch(12, 4, routing=(2, 3, 384))
    write_shards([plain], tmp_path / "plain", max_samples_per_shard=4)
    write_shards([wide], tmp_path / "wide", max_samples_per_shard=4)
    got_plain = TrajectoryBatch.concat(list(read_shards(tmp_path / "plain")))
    (got_wide,) = read_shards(tmp_path / "wide")
    assert first_difference(got_plain, plain) is None
    assert got_plain.routed_experts is None and got_plain.sampling_mask_ids is None
    assert got_wide.routed_experts is not None and got_wide.routed_experts.dtype == torch.uint16
    assert first_difference(got_wide, wide) is None


def test_reading_is_lazy(tmp_path: Path) -> None:
    write_shards(_batches(), tmp_path, max_samples_per_shard=5)
    stream = read_shards(tmp_path)
    first = next(stream)
    (tmp_path / "shard-00002.arrow").unlink()  # not opened yet: the first two shards still stream
    assert first.num_samples == 5 and next(stream).num_samples == 5
    with pytest.raises(FileNotFoundError):
        next(stream)


def test_refuses_to_overwrite_and_checks_manifest(tmp_path: Path) -> None:
    write_shards(_batches()[:1], tmp_path, max_samples_per_shard=5)
    with pytest.raises(FileExistsError):
        write_shards(_batches()[:1], tmp_path, max_samples_per_shard=5)
    body = json.loads((tmp_path / MANIFEST_NAME).read_text())
    body["shards"][0]["num_samples"] = 6
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(TrajectoryError, match="manifest"):
        list(read_shards(tmp_path))
    body["schema_version"] = 99
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(TrajectoryError, match="unsupported schema version"):
        read_manifest(tmp_path)


def test_missing_manifest_and_bad_shard_size(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(read_shards(tmp_path))
    with pytest.raises(TrajectoryError, match="max_samples_per_shard"):
        write_shards([], tmp_path, max_samples_per_shard=0)
    assert write_shards([], tmp_path / "empty", max_samples_per_shard=3).shards == []
