"""Prompt sources: synthetic tasks or JSONL / Parquet files of prompts and answers."""

from __future__ import annotations

import json
import random
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from moe_rl.errors import UserError
from moe_rl.rewards.tasks import BOS, EOS, Prompt, get_task


class DatasetError(UserError):
    """A prompt dataset (or `data.task`) that cannot be used: the file, row / line and column named."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids (PAD 0, BOS 1, EOS 2): vocabulary 259.

    For tiny models trained on text datasets without a tokenizer of their own.
    """

    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [BOS, *(b + self.offset for b in text.encode())]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode(errors="replace")


def read_records(path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs from a `.jsonl` or `.parquet` file.

    Every prompt must be a string and every answer a string or a number; a missing column, a
    null, a list or an unreadable line is a ``ValueError`` naming the file, the row and the column.
    """
    keys = {prompt_key: "data.prompt_key", answer_key: "data.answer_key"}
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, keys)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, keys)
    else:
        raise DatasetError(f"data.task=file:{path}: expected a .jsonl or .parquet file")
    records = [
        (
            _text(path, where, row, prompt_key, _PROMPT_TYPES),
            _text(path, where, row, answer_key, _ANSWER_TYPES),
        )
        for where, row in rows
    ]
    if not records:
        raise DatasetError(f"{path}: no rows")
    return records


_PROMPT_TYPES: tuple[tuple[type, ...], str] = ((str,), "a string")
_ANSWER_TYPES: tuple[tuple[type, ...], str] = ((str, int, float), "a string or a number")


def _parquet_rows(path: Path, keys: dict[str, str]) -> list[tuple[str, dict]]:
    """``(f"row {i}", row)`` for each row (0-based) of the two columns named in ``keys``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise DatasetError(f"{path}: not a readable Parquet file: {err}") from err
    for key, option in keys.items():
        if key not in table.column_names:
            raise DatasetError(f"{path}: no column {key!r} ({option}); columns present: {table.column_names}")
    try:
        rows = table.select(list(keys)).to_pylist()
    except (OSError, pa.ArrowException) as err:
        raise DatasetError(f"{path}: columns {list(keys)} cannot be read: {err}") from err
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def _jsonl_rows(path: Path, keys: dict[str, str]) -> list[tuple[str, dict]]:
    """``(f"line {n}", object)`` for each non-blank line (1-based), every key of ``keys`` present."""
    rows = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
            row = json.loads(line) if line.strip() else None
        except UnicodeDecodeError as err:
            bad = raw[err.start : err.start + 1]
            raise DatasetError(
                f"{path}: line {number} is not UTF-8 text (byte offset {err.start} in the line: {bad!r})"
            ) from err
        except json.JSONDecodeError as err:
            raise DatasetError(
                f"{path}: line {number} is not valid JSON: {err.msg} (column {err.colno})"
            ) from err
        if row is None:
            continue
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {number} is a JSON {type(row).__name__}; expected an object")
        for key, option in keys.items():
            if key not in row:
                raise DatasetError(
                    f"{path}: line {number} has no column {key!r} ({option}); columns: {sorted(row)}"
                )
        rows.append((f"line {number}", row))
    return rows


def _text(path: Path, where: str, row: dict, key: str, allowed: tuple[tuple[type, ...], str]) -> str:
    """``row[key]`` as text; refused unless of an ``allowed`` type (never a null, a list or a bool)."""
    value, (types, description) = row[key], allowed
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "null" if value is None else type(value).__name__
        raise DatasetError(
            f"{path}: {where}, column {key!r}: got {reprlib.repr(value)} ({kind}); expected {description}"
        )
    return str(value)


class PromptSource:
    """Endless, seeded stream of prompts: `next_batch(n)`."""

    def __init__(
        self,
        task: str,
        seed: int,
        tokenizer: Tokenizer | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_prompt_len: int = 512,
    ):
        self.rng = random.Random(seed)
        kind, _, name = task.partition(":")
        self.synthetic = get_task(name) if kind == "synthetic" else None
        self.records: list[tuple[str, str]] = []
        if kind == "file":
            if tokenizer is None:
                raise DatasetError(f"data.task={task}: text prompts need a tokenizer")
            self.records = read_records(Path(name), prompt_key, answer_key)
        elif kind != "synthetic":
            raise DatasetError(f"data.task={task!r}: expected `synthetic:<task>` or `file:<path>`")
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self._order: list[int] = []

    def _next_record(self) -> Prompt:
        if not self._order:
            self._order = list(range(len(self.records)))
            self.rng.shuffle(self._order)
        text, answer = self.records[self._order.pop()]
        ids = [*self.tokenizer.encode(text), EOS]
        if len(ids) > self.max_prompt_len:
            raise DatasetError(
                f"prompt {text[:40]!r}... has {len(ids)} tokens > data.max_prompt_len={self.max_prompt_len}"
            )
        return Prompt(tuple(ids), answer, "file")

    def next_batch(self, n: int) -> list[Prompt]:
        if self.synthetic is not None:
            return self.synthetic.make(n, self.rng)
        return [self._next_record() for _ in range(n)]

    def state(self) -> dict:
        """Resumable state (the RNG and the current epoch order)."""
        return {"rng": self.rng.getstate(), "order": list(self._order)}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])
