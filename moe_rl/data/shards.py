"""On-disk trajectory shards: Arrow IPC files plus a JSON manifest.

Why Arrow IPC (the "Feather v2" file format) rather than Parquet or safetensors:

* ragged data is native: one row per sample with ``large_list`` columns whose offsets are our
  int64 offsets and whose values are our flat tensors, so writing and reading are buffer copies
  (no re-encoding) and the round trip is bit-exact, NaN payloads included;
* a file holds several record batches that can be read one at a time from a memory map, which
  gives streaming reads without loading a whole shard;
* per-buffer zstd / lz4 compression is built in (routing traces compress well);
* schema metadata carries the batch-level fields (engine, quant recipe, policy version, routing
  shape). Parquet re-encodes pages (slower, no zero-copy) and safetensors has neither ragged
  types, nor compression, nor partial reads of a tensor set.

Directory layout: ``shard-00000.arrow``, ``shard-00001.arrow``, ... and ``manifest.json`` (written
last, atomically, so a reader never sees a half-written dataset). A shard holds samples that share
batch-level metadata; a change of engine, quant recipe, policy version or routing shape starts a
new shard. ``old_logp`` is written only when asked (it is recomputed by the trainer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from moe_rl.data.errors import TrajectoryError
from moe_rl.data.trajectory import SCHEMA_VERSION, TrajectoryBatch

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "arrow-ipc"
_META_KEY = b"moe_rl"
_META_FIELDS = ("engine", "quant_recipe", "policy_version", "num_moe_layers", "num_experts", "topk")


@dataclass
class ShardInfo:
    """One shard file as recorded in the manifest."""

    file: str
    num_samples: int
    num_prompt_tokens: int
    num_response_tokens: int
    num_record_batches: int
    num_bytes: int
    engine: str
    quant_recipe: str
    policy_version: int
    min_version: int | None
    max_version: int | None


@dataclass
class Manifest:
    """The JSON manifest of a shard directory."""

    schema_version: int
    format: str
    compression: str | None
    has_old_logp: bool
    shards: list[ShardInfo] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_response_tokens(self) -> int:
        return sum(s.num_response_tokens for s in self.shards)

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body["num_samples"] = self.num_samples
        body["num_response_tokens"] = self.num_response_tokens
        body["num_prompt_tokens"] = sum(s.num_prompt_tokens for s in self.shards)
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        body = json.loads(text)
        if body.get("schema_version") != SCHEMA_VERSION or body.get("format") != FORMAT:
            raise TrajectoryError(
                "manifest",
                "unsupported schema version or format",
                value=(body.get("schema_version"), body.get("format")),
                expected=f"({SCHEMA_VERSION}, {FORMAT!r})",
            )
        shards = [ShardInfo(**s) for s in body["shards"]]
        return cls(
            body["schema_version"],
            body["format"],
            body["compression"],
            body["has_old_logp"],
            shards,
            body.get("metadata", {}),
        )


# ---- writing --------------------------------------------------------------------------------------
def write_shards(
    batches: Iterable[TrajectoryBatch],
    directory: str | os.PathLike[str],
    *,
    max_samples_per_shard: int,
    samples_per_record_batch: int | None = None,
    compression: str | None = "zstd",
    include_old_logp: bool = False,
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    """Write ``batches`` (consumed lazily) as shards under ``directory``; return the manifest.

    ``samples_per_record_batch`` sets the streaming granularity of ``read_shards`` (default: one
    record batch per shard). ``compression`` is ``"zstd"``, ``"lz4"`` or None. Refuses a directory
    that already holds a manifest.
    """
    if max_samples_per_shard < 1:
        raise TrajectoryError("max_samples_per_shard", "must be >= 1", value=max_samples_per_shard)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST_NAME).exists():
        raise FileExistsError(f"{out / MANIFEST_NAME} exists; write shards into a new directory")
    manifest = Manifest(SCHEMA_VERSION, FORMAT, compression, include_old_logp, metadata=dict(metadata or {}))
    writer = _ShardWriter(out, manifest, samples_per_record_batch or max_samples_per_shard)
    for batch in batches:
        _append_batch(writer, batch, max_samples_per_shard)
    writer.flush()
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, out / MANIFEST_NAME)
    logger.info("wrote %d samples in %d shards to %s", manifest.num_samples, len(manifest.shards), out)
    return manifest


def _append_batch(writer: _ShardWriter, batch: TrajectoryBatch, max_samples: int) -> None:
    start = 0
    while start < batch.num_samples:
        if writer.pending and not _same_shard_metadata(writer.pending[0], batch):
            writer.flush()
        take = min(max_samples - writer.num_pending, batch.num_samples - start)
        writer.add(batch.slice(start, start + take))
        start += take
        if writer.num_pending >= max_samples:
            writer.flush()


def _same_shard_metadata(a: TrajectoryBatch, b: TrajectoryBatch) -> bool:
    same_meta = all(getattr(a, f) == getattr(b, f) for f in _META_FIELDS)
    same_fields = all(
        (getattr(a, f) is None) == (getattr(b, f) is None)
        for f in ("sampling_mask_ids", "routed_experts", "old_logp")
    )
    return same_meta and same_fields


class _ShardWriter:
    """Accumulates batches for the current shard and writes it on ``flush``."""

    def __init__(self, directory: Path, manifest: Manifest, samples_per_record_batch: int) -> None:
        self.directory, self.manifest, self.chunk = directory, manifest, samples_per_record_batch
        self.pending: list[TrajectoryBatch] = []

    @property
    def num_pending(self) -> int:
        return sum(b.num_samples for b in self.pending)

    def add(self, batch: TrajectoryBatch) -> None:
        self.pending.append(batch)

    def flush(self) -> None:
        if not self.pending:
            return
        batch = self.pending[0] if len(self.pending) == 1 else TrajectoryBatch.concat(self.pending)
        self.pending = []
        name = f"shard-{len(self.manifest.shards):05d}.arrow"
        num_chunks = _write_shard_file(self.directory / name, batch, self.chunk, self.manifest)
        self.manifest.shards.append(
            _shard_info(name, batch, num_chunks, (self.directory / name).stat().st_size)
        )


def _write_shard_file(path: Path, batch: TrajectoryBatch, chunk: int, manifest: Manifest) -> int:
    schema_meta = {_META_KEY: json.dumps(_batch_metadata(batch)).encode()}
    options = pa.ipc.IpcWriteOptions(compression=manifest.compression)
    tmp = path.with_suffix(".tmp")
    num_chunks = 0
    with pa.OSFile(str(tmp), "wb") as sink:
        writer: pa.ipc.RecordBatchFileWriter | None = None
        for start in range(0, batch.num_samples, chunk):
            piece = batch.slice(start, min(start + chunk, batch.num_samples))
            record = to_record_batch(piece, include_old_logp=manifest.has_old_logp)
            if writer is None:
                writer = pa.ipc.new_file(sink, record.schema.with_metadata(schema_meta), options=options)
            writer.write_batch(record)
            num_chunks += 1
        assert writer is not None
        writer.close()
    os.replace(tmp, path)
    return num_chunks


def _shard_info(name: str, batch: TrajectoryBatch, num_chunks: int, num_bytes: int) -> ShardInfo:
    has_tokens = batch.version_span_versions.numel() > 0
    return ShardInfo(
        file=name,
        num_samples=batch.num_samples,
        num_prompt_tokens=batch.prompt_ids.numel(),
        num_response_tokens=batch.num_response_tokens,
        num_record_batches=num_chunks,
        num_bytes=num_bytes,
        engine=batch.engine,
        quant_recipe=batch.quant_recipe,
        policy_version=batch.policy_version,
        min_version=batch.min_policy_version() if has_tokens else None,
        max_version=batch.max_policy_version() if has_tokens else None,
    )


def _batch_metadata(batch: TrajectoryBatch) -> dict[str, Any]:
    meta: dict[str, Any] = {f: getattr(batch, f) for f in _META_FIELDS}
    meta["schema_version"] = SCHEMA_VERSION
    return meta


def _list(values: Tensor, offsets: Tensor) -> pa.LargeListArray:
    return pa.LargeListArray.from_arrays(pa.array(offsets.numpy()), pa.array(values.contiguous().numpy()))


def to_record_batch(batch: TrajectoryBatch, *, include_old_logp: bool = False) -> pa.RecordBatch:
    """One row per sample; ragged fields as ``large_list`` columns (buffers shared, not re-encoded)."""
    span_offsets = batch.version_span_offsets
    columns: dict[str, pa.Array] = {
        "prompt_ids": _list(batch.prompt_ids, batch.prompt_offsets),
        "response_ids": _list(batch.response_ids, batch.response_offsets),
        "rollout_logp": _list(batch.rollout_logp, batch.response_offsets),
        "reward": pa.array(batch.rewards.numpy()),
        "group_id": pa.array(batch.group_ids.numpy()),
        "finish_reason": pa.array(batch.finish_reasons, pa.string()),
        "version_span_starts": _list(batch.version_span_starts, span_offsets),
        "version_span_versions": _list(batch.version_span_versions, span_offsets),
    }
    if batch.sampling_mask_ids is not None and batch.sampling_mask_offsets is not None:
        rows = _list(batch.sampling_mask_ids, batch.sampling_mask_offsets)
        columns["sampling_mask"] = pa.LargeListArray.from_arrays(
            pa.array(batch.response_offsets.numpy()), rows
        )
    if batch.routed_experts is not None and batch.routing_offsets is not None:
        per_token = batch.routed_experts.shape[1] * batch.routed_experts.shape[2]
        columns["routed_experts"] = _list(batch.routed_experts.reshape(-1), batch.routing_offsets * per_token)
    if include_old_logp and batch.old_logp is not None:
        columns["old_logp"] = _list(batch.old_logp, batch.response_offsets)
    return pa.RecordBatch.from_pydict(columns)


# ---- reading --------------------------------------------------------------------------------------
def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse and check ``directory/manifest.json``."""
    path = Path(directory) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: not a trajectory shard directory (or still being written)"
        )
    return Manifest.from_json(path.read_text())


def read_shards(
    directory: str | os.PathLike[str], *, include_old_logp: bool = True
) -> Iterator[TrajectoryBatch]:
    """Stream the dataset: one ``TrajectoryBatch`` per record batch, shard by shard.

    Only one record batch is decoded at a time (the files are memory-mapped). Per-shard sample
    counts are checked against the manifest.
    """
    manifest = read_manifest(directory)
    for info in manifest.shards:
        seen = 0
        for batch in read_shard_file(Path(directory) / info.file, include_old_logp=include_old_logp):
            seen += batch.num_samples
            yield batch
        if seen != info.num_samples:
            raise TrajectoryError(
                "manifest",
                f"shard {info.file} holds a different number of samples",
                value=seen,
                expected=str(info.num_samples),
            )


def read_shard_file(
    path: str | os.PathLike[str], *, include_old_logp: bool = True
) -> Iterator[TrajectoryBatch]:
    """Stream the record batches of one shard file."""
    with pa.memory_map(str(path), "r") as source:
        reader = pa.ipc.open_file(source)
        meta = json.loads(reader.schema.metadata[_META_KEY])
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise TrajectoryError(
                "schema_version",
                f"unsupported in {path}",
                value=meta.get("schema_version"),
                expected=str(SCHEMA_VERSION),
            )
        for i in range(reader.num_record_batches):
            yield from_record_batch(reader.get_batch(i), meta, include_old_logp=include_old_logp)


def _ragged(column: pa.Array) -> tuple[pa.Array, Tensor]:
    """``(values array, offsets starting at 0)`` of a large_list column, slicing-safe."""
    offsets = column.offsets.to_numpy()
    start, end = int(offsets[0]), int(offsets[-1])
    return column.values.slice(start, end - start), torch.from_numpy(offsets - start)


def _tensor(values: pa.Array) -> Tensor:
    return torch.from_numpy(np.array(values.to_numpy(zero_copy_only=False), copy=True))


def from_record_batch(
    record: pa.RecordBatch, meta: dict[str, Any], *, include_old_logp: bool = True
) -> TrajectoryBatch:
    """Inverse of ``to_record_batch`` (with the shard's schema metadata)."""
    col = record.column
    names = set(record.schema.names)
    prompt_values, prompt_offsets = _ragged(col("prompt_ids"))
    response_values, response_offsets = _ragged(col("response_ids"))
    starts, span_offsets = _ragged(col("version_span_starts"))
    batch = TrajectoryBatch(
        prompt_ids=_tensor(prompt_values),
        prompt_offsets=prompt_offsets,
        response_ids=_tensor(response_values),
        response_offsets=response_offsets,
        rollout_logp=_tensor(_ragged(col("rollout_logp"))[0]),
        rewards=_tensor(col("reward")),
        group_ids=_tensor(col("group_id")),
        finish_reasons=col("finish_reason").to_pylist(),
        version_span_starts=_tensor(starts),
        version_span_versions=_tensor(_ragged(col("version_span_versions"))[0]),
        version_span_offsets=span_offsets,
        **{f: meta[f] for f in _META_FIELDS},
    )
    if "sampling_mask" in names:
        rows, _ = _ragged(col("sampling_mask"))
        mask_values, batch.sampling_mask_offsets = _ragged(rows)
        batch.sampling_mask_ids = _tensor(mask_values)
    if "routed_experts" in names:
        values, offsets = _ragged(col("routed_experts"))
        per_token = meta["num_moe_layers"] * meta["topk"]
        batch.routed_experts = _tensor(values).reshape(-1, meta["num_moe_layers"], meta["topk"])
        batch.routing_offsets = offsets // per_token
    if include_old_logp and "old_logp" in names:
        batch.old_logp = _tensor(_ragged(col("old_logp"))[0])
    return batch


__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ShardInfo",
    "from_record_batch",
    "read_manifest",
    "read_shard_file",
    "read_shards",
    "to_record_batch",
    "write_shards",
]
