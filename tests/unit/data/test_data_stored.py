"""Stored trajectories are validated like live data: each bad case is one ``ShardError`` that names
the file, the field, the sample, the token and the value. Shards are written by ``write_shards``
from a small synthetic batch, then corrupted (the batch before writing, or the files after)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from moe_rl.data import TrajectoryBatch, TrajectoryError, first_difference, ragged
from moe_rl.data.errors import ShardError, ShardNotFoundError
from moe_rl.data.shards import MANIFEST_NAME, read_shards, read_trajectories, write_shards
from moe_rl.data.synthetic import random_batch

VOCAB, LAYERS, TOPK, EXPERTS = 32, 2, 2, 8
LIMITS = {"vocab_size": VOCAB, "num_experts": EXPERTS, "topk": TOPK}
SHARD = "shard-00000.arrow"


def _batch(seed: int = 3, num_samples: int = 4) -> TrajectoryBatch:
    return random_batch(
        seed, num_samples, vocab_size=VOCAB, routing=(LAYERS, TOPK, EXPERTS), sampling_mask=True
    )


def _write(folder: Path, batch: TrajectoryBatch) -> None:
    """One shard of two record batches (samples 0-1, 2-3), so sample numbers cross a batch boundary."""
    write_shards([batch], folder, max_samples_per_shard=4, samples_per_record_batch=2)


def _where(offsets, flat_index: int) -> str:
    sample, token = ragged.locate(offsets, flat_index)
    return f"(sample {sample}, token {token})"


def _last_sample_token(b: TrajectoryBatch) -> int:
    """Flat index of the first response token of the last sample with a response (record batch 1)."""
    lengths = b.response_lengths()
    i = max(j for j in range(b.num_samples) if lengths[j] > 0)
    assert i >= 2, "the synthetic batch must have a response in the second record batch"
    return int(b.response_offsets[i])


# ---- bad contents: the batch is broken, then stored by the project's writer ------------------------
# Each returns the message expected after "<shard path>: ".
def expert_id_out_of_range(b: TrajectoryBatch) -> str:
    assert b.routed_experts is not None and b.routing_offsets is not None
    row = int(b.routing_offsets[3])  # first trace row of sample 3
    b.routed_experts[row, 1, 0] = EXPERTS
    other = int(b.routed_experts[row, 1, 1])
    return (
        f"routed_experts {_where(b.routing_offsets, row)}: expert id >= num_experts (MoE layer 1); "
        f"got [{EXPERTS}, {other}]; expected ids in 0..{EXPERTS - 1}"
    )


def sampled_token_not_kept(b: TrajectoryBatch) -> str:
    assert b.sampling_mask_ids is not None and b.sampling_mask_offsets is not None
    t = _last_sample_token(b)
    lo, hi = int(b.sampling_mask_offsets[t]), int(b.sampling_mask_offsets[t + 1])
    row = b.sampling_mask_ids[lo:hi]
    sampled = int(b.response_ids[t])
    row[row == sampled] = min(set(range(VOCAB)) - set(row.tolist()))
    return (
        f"sampling_mask_ids {_where(b.response_offsets, t)}: sampled token not in its kept set; "
        f"got {sampled}; expected the sampled token among the kept ids"
    )


def positive_rollout_logp(b: TrajectoryBatch) -> str:
    t = _last_sample_token(b)
    b.rollout_logp[t] = 5.0
    return (
        f"rollout_logp {_where(b.response_offsets, t)}: log-prob must be finite and <= 0 "
        "(processed log-probs); got 5.0; expected finite and <= 0.0001"
    )


def token_id_past_vocab(b: TrajectoryBatch) -> str:
    t = _last_sample_token(b)
    b.response_ids[t] = 999
    return (
        f"response_ids {_where(b.response_offsets, t)}: token id out of range; got 999; "
        f"expected 0..{VOCAB - 1} (vocab_size={VOCAB})"
    )


def unknown_finish_reason(b: TrajectoryBatch) -> str:
    b.finish_reasons[3] = "eos"
    return "finish_reasons (sample 3): unknown finish reason; got 'eos'"


def trace_of_another_model(b: TrajectoryBatch) -> str:
    """A valid trace over 8 experts, read for a model with 16."""
    return (
        "num_experts: routing trace recorded with a different MoE shape than the model's; got 8; expected 16"
    )


CONTENT_CASES: list[tuple[Callable[[TrajectoryBatch], str], str, dict[str, int]]] = [
    (expert_id_out_of_range, "routed_experts", {}),
    (sampled_token_not_kept, "sampling_mask_ids", {}),
    (positive_rollout_logp, "rollout_logp", {}),
    (token_id_past_vocab, "response_ids", {}),
    (unknown_finish_reason, "finish_reasons", {}),
    (trace_of_another_model, "num_experts", {"num_experts": 16}),
]


@pytest.mark.parametrize(
    ("corrupt", "field", "limits"), CONTENT_CASES, ids=lambda c: getattr(c, "__name__", "")
)
def test_bad_contents_fail_at_load_naming_file_field_sample_token_value(
    tmp_path: Path, corrupt: Callable[[TrajectoryBatch], str], field: str, limits: dict[str, int]
) -> None:
    batch = _batch()
    expected = corrupt(batch)
    _write(tmp_path / "data", batch)
    with pytest.raises(ShardError) as err:
        list(read_trajectories(tmp_path / "data", **(LIMITS | limits)))
    shard = tmp_path / "data" / SHARD
    assert str(err.value).startswith(f"{shard}: {expected}"), str(err.value)
    assert err.value.path == str(shard) and err.value.field == field
    assert isinstance(err.value.__cause__, TrajectoryError)


def test_sample_numbers_count_from_the_start_of_the_file(tmp_path: Path) -> None:
    batch = _batch()
    batch.finish_reasons[3] = "eos"  # record batch 1, its sample 1
    _write(tmp_path, batch)
    stream = read_shards(tmp_path, **LIMITS)
    assert next(stream).num_samples == 2  # record batch 0 is fine and streams first
    with pytest.raises(ShardError) as err:
        next(stream)
    assert err.value.sample == 3 and "finish_reasons (sample 3)" in str(err.value)


# ---- bad files: valid shards written, then the files corrupted ---------------------------------------
def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _edit_manifest(folder: Path, edit: Callable[[dict], object]) -> None:
    body = _manifest(folder)
    edit(body)
    (folder / MANIFEST_NAME).write_text(json.dumps(body))


def _rewrite_shard(folder: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Replace the shard by ``change(its table)`` (schema metadata kept unless changed), keeping the
    manifest's byte count right so the reader gets to the contents."""
    path = folder / SHARD
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    table = change(table)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _edit_manifest(folder, lambda m: m["shards"][0].update(num_bytes=path.stat().st_size))


def _truncate(folder: Path) -> None:
    path = folder / SHARD
    path.write_bytes(path.read_bytes()[:-100])


def _truncate_and_fix_size(folder: Path) -> None:
    _truncate(folder)
    _edit_manifest(folder, lambda m: m["shards"][0].update(num_bytes=(folder / SHARD).stat().st_size))


def _zero_bytes(folder: Path) -> None:
    path = folder / SHARD
    path.write_bytes(bytes(path.stat().st_size))


def _set_column(name: str, array: pa.Array) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        index = table.schema.get_field_index(name)
        return table.set_column(index, name, array).replace_schema_metadata(table.schema.metadata)

    return change


def _null_reward(table: pa.Table) -> pa.Table:
    rewards = table.column("reward").to_pylist()
    return _set_column("reward", pa.array([None, *rewards[1:]], pa.float32()))(table)


def _double_reward(table: pa.Table) -> pa.Table:
    return _set_column("reward", table.column("reward").cast(pa.float64()))(table)


def _extra_column(table: pa.Table) -> pa.Table:
    return table.append_column("advantage", pa.array([0.0] * table.num_rows, pa.float32()))


def _metadata(value: bytes | None) -> Callable[[pa.Table], pa.Table]:
    return lambda table: table.replace_schema_metadata(None if value is None else {b"moe_rl": value})


@dataclass
class FileCase:
    corrupt: Callable[[Path], None]
    file: str
    field: str
    message: str
    error: type[ShardError] = ShardError


FILE_CASES = {
    "truncated shard": FileCase(
        _truncate, SHARD, "", "file size differs from the manifest (truncated or overwritten); got "
    ),
    "truncated shard, manifest agrees": FileCase(
        _truncate_and_fix_size, SHARD, "", "not a readable Arrow IPC file (corrupt or truncated): "
    ),
    "zeroed shard": FileCase(_zero_bytes, SHARD, "", "not a readable Arrow IPC file (corrupt or truncated): "),
    "missing column": FileCase(
        lambda d: _rewrite_shard(d, lambda t: t.drop_columns(["rollout_logp"])),
        SHARD, "rollout_logp", "rollout_logp: missing column; got ['prompt_ids', 'response_ids', 'reward'",
    ),
    "wrong column type": FileCase(
        lambda d: _rewrite_shard(d, _double_reward), SHARD, "reward",
        "reward: wrong column type; got 'double'; expected float",
    ),
    "unknown column": FileCase(
        lambda d: _rewrite_shard(d, _extra_column), SHARD, "advantage",
        "advantage: unknown column; expected one of ['prompt_ids'",
    ),
    "null entry": FileCase(
        lambda d: _rewrite_shard(d, _null_reward), SHARD, "reward", "reward: null entries; got 1; expected no nulls"
    ),
    "no schema metadata": FileCase(
        lambda d: _rewrite_shard(d, _metadata(None)), SHARD, "schema metadata",
        "schema metadata: no 'moe_rl' entry (not written by write_shards)",
    ),
    "schema metadata not JSON": FileCase(
        lambda d: _rewrite_shard(d, _metadata(b"{engine")), SHARD, "schema metadata",
        "schema metadata: not valid JSON: ",
    ),
    "manifest not JSON": FileCase(
        lambda d: (d / MANIFEST_NAME).write_text('{"shards": ['), MANIFEST_NAME, "",
        "not valid JSON: Expecting value: line 1 column 13",
    ),
    "manifest not UTF-8": FileCase(
        lambda d: (d / MANIFEST_NAME).write_bytes(b"\xff" + (d / MANIFEST_NAME).read_bytes()), MANIFEST_NAME,
        "", "not UTF-8 text (byte 0): corrupt",
    ),
    "manifest key missing": FileCase(
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].pop("num_bytes")), MANIFEST_NAME,
        "shards[0].num_bytes", "shards[0].num_bytes: missing key; expected int (keys present: ['engine'",
    ),
    "manifest value of the wrong type": FileCase(
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(num_samples="4")), MANIFEST_NAME,
        "shards[0].num_samples", "shards[0].num_samples: wrong type; got '4'; expected int",
    ),
    "manifest shard outside its folder": FileCase(
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(file="../shard-00000.arrow")),
        MANIFEST_NAME, "shards[0].file", "shards[0].file: not a file name in the manifest's folder; got '../shard",
    ),
    "manifest of another schema version": FileCase(
        lambda d: _edit_manifest(d, lambda m: m.update(schema_version=99)), MANIFEST_NAME, "schema_version",
        "schema_version: unsupported schema version or format; got (99, 'arrow-ipc'); expected (1, 'arrow-ipc')",
    ),
    "manifest size mismatch": FileCase(
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(num_bytes=m["shards"][0]["num_bytes"] + 1)),
        SHARD, "", "file size differs from the manifest (truncated or overwritten); got ",
    ),
    "manifest sample count mismatch": FileCase(
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(num_samples=9)), MANIFEST_NAME,
        "shards[0].num_samples", f"shards[0].num_samples: does not match {SHARD}; got 9; expected 4 (what the file holds)",
    ),
    "listed shard missing": FileCase(
        lambda d: (d / SHARD).unlink(), SHARD, "", "listed in manifest.json (shards[0]) but missing",
        ShardNotFoundError,
    ),
    "manifest missing": FileCase(
        lambda d: (d / MANIFEST_NAME).unlink(), MANIFEST_NAME, "",
        "not found: not a trajectory shard directory (or still being written)", ShardNotFoundError,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", FILE_CASES.values(), ids=FILE_CASES.keys())
def test_bad_files_are_one_error_naming_the_file(tmp_path: Path, case: FileCase) -> None:
    _write(tmp_path, _batch())
    case.corrupt(tmp_path)
    with pytest.raises(case.error) as err:
        list(read_shards(tmp_path, **LIMITS))
    assert type(err.value) is case.error
    assert str(err.value).startswith(f"{tmp_path / case.file}: {case.message}"), str(err.value)
    assert err.value.path == str(tmp_path / case.file) and err.value.field == case.field


def test_missing_files_are_also_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(read_shards(tmp_path / "nothing"))


# ---- layouts: a shard folder, or a run's trajectories/ of step folders ---------------------------------
def test_a_runs_trajectories_folder_is_read_in_step_order(tmp_path: Path) -> None:
    run = tmp_path / "run" / "trajectories"
    steps = (2, 10, 999_999, 1_000_000)  # by name, step_1000000 would come before step_999999
    batches = {step: _batch(seed=step % 97, num_samples=2) for step in steps}
    for step in reversed(steps):
        _write(run / f"step_{step:06d}", batches[step])
    got = TrajectoryBatch.concat(list(read_trajectories(run, **LIMITS)))
    assert first_difference(got, TrajectoryBatch.concat([batches[s] for s in steps])) is None
    (one,) = read_trajectories(run / "step_000010", **LIMITS)  # a shard folder is read as is
    assert first_difference(one, batches[10]) is None


def test_step_folders_are_validated_and_unfinished_ones_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "step_000000", _batch(seed=0, num_samples=2))
    (tmp_path / "step_000001").mkdir()  # being written: no manifest yet
    with caplog.at_level(logging.WARNING, logger="moe_rl.data.shards"):
        assert sum(b.num_samples for b in read_trajectories(tmp_path, **LIMITS)) == 2
    assert "skipping subfolders without manifest.json: ['step_000001']" in caplog.text
    bad = _batch(seed=2, num_samples=2)
    bad.rollout_logp[0] = 5.0
    _write(tmp_path / "step_000002", bad)
    with pytest.raises(
        ShardError, match=r"step_000002/shard-00000.arrow: rollout_logp \(sample 0, token 0\)"
    ):
        list(read_trajectories(tmp_path, **LIMITS))


@pytest.mark.parametrize(
    "layout", ["empty folder", "subfolders without manifests", "no such folder", "a file"]
)
def test_a_folder_without_shards_is_one_error_naming_it(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / "trajectories"
    if layout == "a file":
        folder.write_text("")
    elif layout != "no such folder":
        folder.mkdir()
    if layout == "subfolders without manifests":
        (folder / "step_000000").mkdir()
    with pytest.raises(ShardNotFoundError) as err:
        list(read_trajectories(folder))
    message = str(err.value)
    assert message.startswith(f"{folder}: ") and err.value.path == str(folder)
    problem = {
        "empty folder": "no manifest.json in it and no subfolders",
        "subfolders without manifests": "no manifest.json in it or in its subfolders ['step_000000']",
        "no such folder": "no such folder",
        "a file": "no such folder",
    }[layout]
    assert problem in message
    assert "expected a shard folder (manifest.json + shard-*.arrow" in message
    assert "a run's trajectories/ with step_*/ subfolders" in message
