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
new shard. ``old_logp`` is written only when asked (it is recomputed by the trainer). Multi-turn
batches add a ``sampled`` column (who wrote each response token); shards written without one,
single-turn data, read with ``sampled`` None, as before it existed. A run's
``trajectories/`` holds one such directory per step (``step_000003/``); ``read_trajectories`` reads
either layout.

Reading treats the files as untrusted input: every batch passes ``validate`` (with the model's
limits when the caller gives them) before it is yielded, and a corrupt file, a wrong schema or a
manifest that disagrees with its shards is one ``ShardError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from moe_rl.data.errors import ShardError, ShardNotFoundError, TrajectoryError
from moe_rl.data.trajectory import SCHEMA_VERSION, TrajectoryBatch
from moe_rl.data.validate import validate

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
    def from_json(cls, text: str, source: str | os.PathLike[str] = MANIFEST_NAME) -> Manifest:
        """Parse a manifest; anything malformed is a ``ShardError`` naming ``source`` and the key."""
        try:
            body = json.loads(text)
        except ValueError as err:  # json.JSONDecodeError, or an integer too long to parse
            raise ShardError(source, "", f"not valid JSON: {err}") from err
        _check_entries(source, body, {}, "")
        if (body.get("schema_version"), body.get("format")) != (SCHEMA_VERSION, FORMAT):
            raise ShardError(
                source,
                "schema_version",
                "unsupported schema version or format",
                value=(_scalar(body.get("schema_version")), _scalar(body.get("format"))),
                expected=f"({SCHEMA_VERSION}, {FORMAT!r})",
            )
        _check_entries(source, body, _MANIFEST_KEYS, "")
        shards = []
        for i, entry in enumerate(body["shards"]):
            _check_entries(source, entry, _SHARD_KEYS, f"shards[{i}].")
            _check_file_name(source, entry["file"], f"shards[{i}].file")
            shards.append(ShardInfo(**{key: entry[key] for key in _SHARD_KEYS}))
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ShardError(source, "metadata", "wrong type", value=_scalar(metadata), expected="an object")
        return cls(
            body["schema_version"],
            body["format"],
            body["compression"],
            body["has_old_logp"],
            shards,
            metadata,
        )


_MANIFEST_KEYS: dict[str, Any] = {
    "schema_version": int,
    "format": str,
    "compression": str | None,
    "has_old_logp": bool,
    "shards": list,
}
_SHARD_KEYS: dict[str, Any] = get_type_hints(ShardInfo)


def _scalar(value: object) -> object:
    """``value`` itself when short to print, else its type name (for error messages)."""
    short = (
        value is None
        or isinstance(value, bool | int | float)
        or (isinstance(value, str) and len(value) <= 80)
    )
    return value if short else type(value).__name__


def _check_entries(source: str | os.PathLike[str], body: object, types: dict[str, Any], where: str) -> None:
    """``body`` is a JSON object holding each key of ``types`` with a value of that type."""
    if not isinstance(body, dict):
        raise ShardError(source, where.rstrip("."), "wrong type", value=_scalar(body), expected="an object")
    for key, kind in types.items():
        name = kind.__name__ if isinstance(kind, type) else str(kind)
        if key not in body:
            raise ShardError(
                source, where + key, "missing key", expected=f"{name} (keys present: {sorted(body)})"
            )
        value = body[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ShardError(source, where + key, "wrong type", value=_scalar(value), expected=name)


def _check_file_name(source: str | os.PathLike[str], name: str, field: str) -> None:
    """A shard is a plain file name inside the manifest's folder."""
    if name in ("", ".", "..") or "\x00" in name or Path(name).name != name:
        raise ShardError(
            source, field, "not a file name in the manifest's folder", value=_scalar(name),
            expected="a plain file name such as 'shard-00000.arrow'",
        )  # fmt: skip


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
        for f in ("sampling_mask_ids", "routed_experts", "old_logp", "sampled")
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
    if batch.sampled is not None:
        columns["sampled"] = _list(batch.sampled, batch.response_offsets)
    return pa.RecordBatch.from_pydict(columns)


# ---- reading --------------------------------------------------------------------------------------
_COLUMNS = {
    "prompt_ids": pa.large_list(pa.int32()),
    "response_ids": pa.large_list(pa.int32()),
    "rollout_logp": pa.large_list(pa.float32()),
    "reward": pa.float32(),
    "group_id": pa.int64(),
    "finish_reason": pa.string(),
    "version_span_starts": pa.large_list(pa.int64()),
    "version_span_versions": pa.large_list(pa.int64()),
}
_OPTIONAL_COLUMNS = {
    "sampling_mask": (pa.large_list(pa.large_list(pa.int32())),),
    "routed_experts": (pa.large_list(pa.uint8()), pa.large_list(pa.uint16())),
    "old_logp": (pa.large_list(pa.float32()),),
    "sampled": (pa.large_list(pa.bool_()),),
}


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse and check ``directory/manifest.json``."""
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError) as err:
        raise ShardNotFoundError(
            path, "", "not found: not a trajectory shard directory (or still being written)"
        ) from err
    except UnicodeDecodeError as err:
        raise ShardError(path, "", f"not UTF-8 text (byte {err.start}): corrupt") from err
    except OSError as err:
        raise ShardError(path, "", f"unreadable: {err}") from err
    return Manifest.from_json(text, path)


def read_shards(
    directory: str | os.PathLike[str],
    *,
    include_old_logp: bool = True,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    topk: int | None = None,
) -> Iterator[TrajectoryBatch]:
    """Stream the dataset: one validated ``TrajectoryBatch`` per record batch, shard by shard.

    Only one record batch is decoded at a time (the files are memory-mapped). Each shard's size,
    record batches, samples and tokens are checked against the manifest; each batch passes
    ``validate`` with the given model limits (see there) before it is yielded.
    """
    manifest = read_manifest(directory)
    limits = {"vocab_size": vocab_size, "num_experts": num_experts, "topk": topk}
    for index, info in enumerate(manifest.shards):
        yield from _read_listed_shard(Path(directory), index, info, include_old_logp, limits)


def _read_listed_shard(
    directory: Path, index: int, info: ShardInfo, include_old_logp: bool, limits: dict[str, int | None]
) -> Iterator[TrajectoryBatch]:
    """Shard ``index`` of the manifest, checked against its entry ``info``."""
    path = directory / info.file
    try:
        size = path.stat().st_size
    except FileNotFoundError as err:
        raise ShardNotFoundError(
            path, "", f"listed in {MANIFEST_NAME} (shards[{index}]) but missing"
        ) from err
    except OSError as err:
        raise ShardError(path, "", f"cannot open: {err}") from err
    if size != info.num_bytes:
        raise ShardError(
            path, "", "file size differs from the manifest (truncated or overwritten)", value=size,
            expected=f"{info.num_bytes} bytes ({MANIFEST_NAME} shards[{index}].num_bytes)",
        )  # fmt: skip
    seen = {"num_record_batches": 0, "num_samples": 0, "num_prompt_tokens": 0, "num_response_tokens": 0}
    for batch in read_shard_file(path, include_old_logp=include_old_logp, **limits):
        seen["num_record_batches"] += 1
        seen["num_samples"] += batch.num_samples
        seen["num_prompt_tokens"] += batch.prompt_ids.numel()
        seen["num_response_tokens"] += batch.num_response_tokens
        yield batch
    for key, count in seen.items():
        if getattr(info, key) != count:
            raise ShardError(
                directory / MANIFEST_NAME, f"shards[{index}].{key}", f"does not match {info.file}",
                value=getattr(info, key), expected=f"{count} (what the file holds)",
            )  # fmt: skip


def read_shard_file(
    path: str | os.PathLike[str],
    *,
    include_old_logp: bool = True,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    topk: int | None = None,
) -> Iterator[TrajectoryBatch]:
    """Stream the record batches of one shard file, each checked by ``validate`` (model limits as
    in ``read_shards``); samples in errors are counted from the start of the file."""
    path = Path(path)
    with _memory_map(path) as source:
        reader = _open_file(source, path)
        meta = _shard_metadata(reader.schema, path)
        first_sample = 0
        for i in range(reader.num_record_batches):
            record = _record_batch(reader, i, path)
            try:
                batch = from_record_batch(record, meta, include_old_logp=include_old_logp)
                validate(batch, vocab_size=vocab_size, num_experts=num_experts, topk=topk)
            except TrajectoryError as err:
                raise ShardError.wrap(path, err, first_sample=first_sample) from err
            first_sample += batch.num_samples
            yield batch


def _memory_map(path: Path) -> pa.MemoryMappedFile:
    try:
        return pa.memory_map(str(path), "r")
    except FileNotFoundError as err:
        raise ShardNotFoundError(path, "", "shard file not found") from err
    except (OSError, pa.ArrowException) as err:
        raise ShardError(path, "", f"cannot open: {err}") from err


def _open_file(source: pa.MemoryMappedFile, path: Path) -> pa.ipc.RecordBatchFileReader:
    """The IPC reader, its column names decodable."""
    try:
        reader = pa.ipc.open_file(source)
        _ = reader.schema.names  # decoded lazily (strict UTF-8): decode them here
    except (OSError, pa.ArrowException) as err:
        raise ShardError(path, "", f"not a readable Arrow IPC file (corrupt or truncated): {err}") from err
    except UnicodeDecodeError as err:
        raise ShardError(path, "", f"corrupt schema: a column name is not UTF-8 ({err.reason})") from err
    return reader


def _record_batch(reader: pa.ipc.RecordBatchFileReader, index: int, path: Path) -> pa.RecordBatch:
    """Record batch ``index``, its buffers fully checked (offsets in bounds, valid UTF-8)."""
    try:
        record = reader.get_batch(index)
        record.validate(full=True)
    except (OSError, pa.ArrowException) as err:
        raise ShardError(path, "", f"record batch {index} is corrupt: {err}") from err
    return record


def _shard_metadata(schema: pa.Schema, path: Path) -> dict[str, Any]:
    """The batch-level fields stored in the schema metadata (see ``write_shards``)."""
    raw = (schema.metadata or {}).get(_META_KEY)
    if raw is None:
        raise ShardError(
            path, "schema metadata", f"no {_META_KEY.decode()!r} entry (not written by write_shards)"
        )
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ShardError(path, "schema metadata", f"not valid JSON: {err}") from err
    if not isinstance(meta, dict):
        raise ShardError(path, "schema metadata", "wrong type", value=_scalar(meta), expected="an object")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ShardError(
            path, "schema_version", "unsupported", value=_scalar(meta.get("schema_version")),
            expected=str(SCHEMA_VERSION),
        )  # fmt: skip
    missing = [name for name in _META_FIELDS if name not in meta]
    if missing:
        raise ShardError(
            path, "schema metadata", "missing keys", value=missing, expected=str(list(_META_FIELDS))
        )
    return meta


def _ragged(column: pa.Array) -> tuple[pa.Array, Tensor]:
    """``(values array, offsets starting at 0)`` of a large_list column, slicing-safe."""
    offsets = column.offsets.to_numpy()
    start, end = int(offsets[0]), int(offsets[-1])
    return column.values.slice(start, end - start), torch.from_numpy(offsets - start)


def _tensor(values: pa.Array) -> Tensor:
    return torch.from_numpy(np.array(values.to_numpy(zero_copy_only=False), copy=True))


def _check_columns(record: pa.RecordBatch) -> None:
    """Every required column, no unknown one, each with the type ``to_record_batch`` writes, no nulls."""
    names = record.schema.names
    for name in _COLUMNS:
        if name not in names:
            raise TrajectoryError(name, "missing column", value=names, expected=f"columns {list(_COLUMNS)}")
    for name, column in zip(names, record.columns, strict=True):
        allowed = (_COLUMNS[name],) if name in _COLUMNS else _OPTIONAL_COLUMNS.get(name)
        if allowed is None:
            raise TrajectoryError(
                name, "unknown column", expected=f"one of {[*_COLUMNS, *_OPTIONAL_COLUMNS]}"
            )
        if column.type not in allowed:
            raise TrajectoryError(
                name, "wrong column type", value=str(column.type), expected=" or ".join(map(str, allowed))
            )
        array = column
        while True:
            if array.null_count:
                raise TrajectoryError(name, "null entries", value=array.null_count, expected="no nulls")
            if not pa.types.is_large_list(array.type):
                break
            array = array.values


def _check_aligned(name: str, offsets: Tensor, reference: str, reference_offsets: Tensor) -> None:
    """A column whose rows must have the lengths of ``reference``'s rows."""
    bad = torch.nonzero(torch.diff(offsets) != torch.diff(reference_offsets)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise TrajectoryError(
            name, f"row length differs from {reference}", sample=i,
            value=int(offsets[i + 1] - offsets[i]), expected=str(int(reference_offsets[i + 1] - reference_offsets[i])),
        )  # fmt: skip


def _routing_shape(meta: dict[str, Any]) -> tuple[int, int]:
    """``(num_moe_layers, topk)`` from the metadata of a shard with a routed_experts column."""
    for name in ("num_moe_layers", "topk"):
        value = meta[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TrajectoryError(
                name,
                "must be an int >= 1 in a shard with routed_experts (schema metadata)",
                value=_scalar(value),
            )
    return meta["num_moe_layers"], meta["topk"]


def from_record_batch(
    record: pa.RecordBatch, meta: dict[str, Any], *, include_old_logp: bool = True
) -> TrajectoryBatch:
    """Inverse of ``to_record_batch`` (with the shard's schema metadata).

    Checks what decoding relies on (columns, types, no nulls, rows that line up) and raises
    ``TrajectoryError`` naming the column; the contract itself is ``validate``'s job.
    """
    _check_columns(record)
    col = record.column
    names = set(record.schema.names)
    prompt_values, prompt_offsets = _ragged(col("prompt_ids"))
    response_values, response_offsets = _ragged(col("response_ids"))
    starts, span_offsets = _ragged(col("version_span_starts"))
    logp_values, logp_offsets = _ragged(col("rollout_logp"))
    versions, version_offsets = _ragged(col("version_span_versions"))
    _check_aligned("rollout_logp", logp_offsets, "response_ids", response_offsets)
    _check_aligned("version_span_versions", version_offsets, "version_span_starts", span_offsets)
    batch = TrajectoryBatch(
        prompt_ids=_tensor(prompt_values),
        prompt_offsets=prompt_offsets,
        response_ids=_tensor(response_values),
        response_offsets=response_offsets,
        rollout_logp=_tensor(logp_values),
        rewards=_tensor(col("reward")),
        group_ids=_tensor(col("group_id")),
        finish_reasons=col("finish_reason").to_pylist(),
        version_span_starts=_tensor(starts),
        version_span_versions=_tensor(versions),
        version_span_offsets=span_offsets,
        **{f: meta[f] for f in _META_FIELDS},
    )
    if "sampling_mask" in names:
        rows, row_offsets = _ragged(col("sampling_mask"))
        _check_aligned("sampling_mask", row_offsets, "response_ids", response_offsets)
        mask_values, batch.sampling_mask_offsets = _ragged(rows)
        batch.sampling_mask_ids = _tensor(mask_values)
    if "routed_experts" in names:
        _decode_routing(batch, col("routed_experts"), meta)
    if include_old_logp and "old_logp" in names:
        values, offsets = _ragged(col("old_logp"))
        _check_aligned("old_logp", offsets, "response_ids", response_offsets)
        batch.old_logp = _tensor(values)
    if "sampled" in names:  # multi-turn shards; older (single-turn) shards have no such column
        values, offsets = _ragged(col("sampled"))
        _check_aligned("sampled", offsets, "response_ids", response_offsets)
        batch.sampled = _tensor(values)
    return batch


def _decode_routing(batch: TrajectoryBatch, column: pa.Array, meta: dict[str, Any]) -> None:
    layers, topk = _routing_shape(meta)
    values, offsets = _ragged(column)
    per_token = layers * topk
    ragged_rows = torch.nonzero(offsets % per_token).flatten()
    if ragged_rows.numel():
        raise TrajectoryError(
            "routed_experts", "trace is not whole tokens", sample=max(int(ragged_rows[0]) - 1, 0),
            value=int(offsets[ragged_rows[0]]), expected=f"a multiple of num_moe_layers * topk = {per_token}",
        )  # fmt: skip
    batch.routed_experts = _tensor(values).reshape(-1, layers, topk)
    batch.routing_offsets = offsets // per_token


def read_trajectories(
    folder: str | os.PathLike[str],
    *,
    include_old_logp: bool = True,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    topk: int | None = None,
) -> Iterator[TrajectoryBatch]:
    """Stored trajectories as ``read_shards`` streams them, from a shard folder (it has a
    ``manifest.json``) or a folder of shard folders: a run's ``trajectories/`` (``step_*/``) or the
    offline data's ``batch_*/``, read in step order (numbers compared as numbers)."""
    limits = {"vocab_size": vocab_size, "num_experts": num_experts, "topk": topk}
    for part in trajectory_folders(folder):
        yield from read_shards(part, include_old_logp=include_old_logp, **limits)


def trajectory_folders(folder: str | os.PathLike[str]) -> list[Path]:
    """The shard folders of ``folder`` (see ``read_trajectories``); neither layout is an error."""
    root = Path(folder)
    if (root / MANIFEST_NAME).is_file():
        return [root]
    expected = (
        f"a shard folder ({MANIFEST_NAME} + shard-*.arrow, as write_shards leaves it) or a folder of them "
        "(a run's trajectories/ with step_*/ subfolders)"
    )
    if not root.is_dir():
        raise ShardNotFoundError(root, "", "no such folder", expected=expected)
    subfolders = sorted((p for p in root.iterdir() if p.is_dir()), key=_step_order)
    parts = [p for p in subfolders if (p / MANIFEST_NAME).is_file()]
    if not parts:
        names = [p.name for p in subfolders]
        found = (
            f"or in its subfolders {names[:10]}{' ...' if len(names) > 10 else ''}"
            if names
            else "and no subfolders"
        )
        raise ShardNotFoundError(root, "", f"no {MANIFEST_NAME} in it {found}", expected=expected)
    skipped = [p.name for p in subfolders if p not in parts]
    if skipped:
        logger.warning("%s: skipping subfolders without %s: %s", root, MANIFEST_NAME, skipped)
    return parts


def _step_order(path: Path) -> list[tuple[int, int | str]]:
    """Sort key reading digit runs as numbers: ``step_9`` < ``step_10``."""
    parts = re.split(r"(\d+)", path.name)  # odd positions hold the digit runs
    return [(1, int(part)) if i % 2 else (0, part) for i, part in enumerate(parts)]


__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ShardInfo",
    "from_record_batch",
    "read_manifest",
    "read_shard_file",
    "read_shards",
    "read_trajectories",
    "to_record_batch",
    "trajectory_folders",
    "write_shards",
]
