"""Prompt sources: synthetic tasks or JSONL / Parquet files of prompts and answers.

A file record becomes prompt text through `data.prompt_template` (a format string over its fields)
or its `data.prompt_key` column, then token ids through the tokenizer, rendered as a user turn by
the tokenizer's chat template with `data.chat_template`. The rules that need the file or the
tokenizer live here and run when the source is built, which `moe-rl train` does before anything
heavy starts: every record is read and checked (a field the template names missing from a record
is an error naming the field, the record and the file), and a chat template that is missing or
fails is an error naming the tokenizer. The rules on the keys alone live in
`moe_rl.config.validate`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moe_rl.config.modes import TaskKind, TaskSource
from moe_rl.config.validate import prompt_template_fields
from moe_rl.errors import UserError
from moe_rl.rewards.tasks import BOS, EOS, Prompt, get_task, until_eos


class DatasetError(UserError):
    """A prompt dataset (or `data.task`) that cannot be used: the file, row / line and column named."""


@dataclass(frozen=True)
class ChatFormat:
    """`data.chat_template`: each prompt is a user turn, after a system turn when
    `data.system_prompt` is set; `kwargs` (`data.chat_template_kwargs`) go to the template."""

    system_prompt: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def messages(self, text: str) -> list[dict[str, str]]:
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return [*system, {"role": "user", "content": text}]


class Tokenizer(Protocol):
    name: str
    """What the tokenizer is, for error messages."""
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_prompt(self, text: str, chat: ChatFormat | None = None) -> list[int]: ...
    def decode_response(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids (PAD 0, BOS 1, EOS 2): vocabulary 259.

    For tiny models trained on text datasets without a tokenizer of their own. A prompt is
    `BOS bytes EOS` (the layout of the synthetic tasks); a response ends at its first EOS.
    """

    name = "the byte tokenizer (used when model.hf_path holds no tokenizer_config.json)"
    chat_template = None
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [BOS, *(b + self.offset for b in text.encode())]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode(errors="replace")

    def encode_prompt(self, text: str, chat: ChatFormat | None = None) -> list[int]:
        assert chat is None, "the byte tokenizer has no chat template"
        return [*self.encode(text), EOS]

    def decode_response(self, ids: Sequence[int]) -> str:
        return self.decode(until_eos(ids))


class HFTokenizer:
    """The tokenizer of a Hugging Face folder (`model.hf_path`), loaded with `AutoTokenizer`.

    A plain prompt is encoded as the tokenizer encodes text (its own BOS, if any); a chat prompt is
    rendered by `apply_chat_template(messages, add_generation_prompt=True, **kwargs)` and encoded
    without adding special tokens again (the template writes them). A response is decoded up to
    `eos_token_id` (`model.eos_token_id`, where generation stops) without special tokens.
    """

    def __init__(self, folder: str | Path, eos_token_id: int | None = None):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(folder)
        self.name = f"the tokenizer of model.hf_path={folder}"
        self.eos_token_id = eos_token_id

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def render_chat(self, text: str, chat: ChatFormat) -> str:
        """The prompt as the chat template writes it, ending with the assistant turn's opening."""
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                chat.messages(text), tokenize=False, add_generation_prompt=True, **chat.kwargs
            )
        except TemplateError as err:
            raise DatasetError(
                f"data.chat_template: the chat template of {self.name} failed on prompt {text[:40]!r}: {err}"
            ) from err

    def encode_prompt(self, text: str, chat: ChatFormat | None = None) -> list[int]:
        if chat is None:
            return self.hf.encode(text)
        return self.hf.encode(self.render_chat(text, chat), add_special_tokens=False)

    def decode_response(self, ids: Sequence[int]) -> str:
        body = list(ids)
        if self.eos_token_id in body:
            body = body[: body.index(self.eos_token_id)]
        return self.hf.decode(body, skip_special_tokens=True)


def read_records(
    path: Path, prompt_key: str, answer_key: str, prompt_template: str | None = None
) -> list[tuple[str, str]]:
    """(prompt, answer) pairs from a `.jsonl` or `.parquet` file.

    The prompt is the `prompt_key` column, or with `prompt_template` the template filled with the
    record's fields. Every prompt must be a string, every answer and every field the template names
    a string or a number; a missing column, a null, a list or an unreadable line is a
    ``ValueError`` naming the file, the row and the column.
    """
    return [
        (prompt, answer)
        for _, prompt, answer in located_records(path, prompt_key, answer_key, prompt_template)
    ]


def located_records(
    path: Path, prompt_key: str, answer_key: str, prompt_template: str | None = None
) -> list[tuple[str, str, str]]:
    """``(where, prompt, answer)`` of every record (`read_records`; ``where`` is ``line N`` or ``row N``)."""
    if prompt_template is None:
        keys = {prompt_key: "data.prompt_key"}
    else:
        keys = dict.fromkeys(prompt_template_fields(prompt_template), "data.prompt_template")
    keys.setdefault(answer_key, "data.answer_key")
    if path.is_dir():
        raise DatasetError(f"data.task=file:{path}: is a folder; expected a .jsonl or .parquet file")
    if not path.exists():
        raise DatasetError(f"data.task=file:{path}: no such file")
    if not os.access(path, os.R_OK):
        raise DatasetError(f"data.task=file:{path}: cannot be read (permission denied)")
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, keys)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, keys)
    else:
        raise DatasetError(f"data.task=file:{path}: expected a .jsonl or .parquet file")
    records = [
        (
            where,
            _text(path, where, row, prompt_key, _PROMPT_TYPES)
            if prompt_template is None
            else _fill(path, where, row, prompt_template),
            _text(path, where, row, answer_key, _ANSWER_TYPES),
        )
        for where, row in rows
    ]
    if not records:
        raise DatasetError(f"{path}: no rows")
    return records


_PROMPT_TYPES: tuple[tuple[type, ...], str] = ((str,), "a string")
_ANSWER_TYPES: tuple[tuple[type, ...], str] = ((str, int, float), "a string or a number")
_FIELD_TYPES = _ANSWER_TYPES


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


def _value(path: Path, where: str, row: dict, key: str, allowed: tuple[tuple[type, ...], str]) -> Any:
    """``row[key]``, refused unless of an ``allowed`` type (never a null, a list or a bool)."""
    value, (types, description) = row[key], allowed
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "null" if value is None else type(value).__name__
        raise DatasetError(
            f"{path}: {where}, column {key!r}: got {reprlib.repr(value)} ({kind}); expected {description}"
        )
    return value


def _text(path: Path, where: str, row: dict, key: str, allowed: tuple[tuple[type, ...], str]) -> str:
    return str(_value(path, where, row, key, allowed))


def _fill(path: Path, where: str, row: dict, template: str) -> str:
    """``template`` filled with the record's fields (each a string or a number)."""
    values = {key: _value(path, where, row, key, _FIELD_TYPES) for key in prompt_template_fields(template)}
    try:
        return template.format(**values)
    except (ValueError, TypeError, KeyError) as err:  # a format spec the value does not take
        raise DatasetError(
            f"{path}: {where}: data.prompt_template={template!r} cannot format the record's fields "
            f"{reprlib.repr(values)}: {err}"
        ) from err


def _check_chat_template(tokenizer: Tokenizer) -> None:
    if tokenizer.chat_template is None:
        raise DatasetError(
            f"data.chat_template=true needs a tokenizer with a chat template; {tokenizer.name} has none (no "
            "`chat_template` in its tokenizer_config.json or chat_template.jinja): set "
            "data.chat_template=false (data.prompt_template still formats the prompts), or point "
            "model.hf_path at a folder whose tokenizer has one"
        )


class PromptSource:
    """Endless, seeded stream of prompts: `next_batch(n)`."""

    def __init__(
        self,
        task: TaskSource | str,
        seed: int,
        tokenizer: Tokenizer | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_prompt_len: int = 512,
        prompt_template: str | None = None,
        chat: ChatFormat | None = None,
    ):
        """``task``: `data.task`, read (`DataConfig.source`) or as the recipe spells it."""
        self.rng = random.Random(seed)
        task = TaskSource.parse(task) if isinstance(task, str) else task
        self.synthetic = get_task(task.name) if task.kind == TaskKind.SYNTHETIC else None
        self.records: list[tuple[tuple[int, ...], str]] = []
        """Every record of a file task: its prompt's token ids and its answer."""
        if task.is_file:
            if tokenizer is None:
                raise DatasetError(f"data.task={task}: text prompts need a tokenizer")
            path = Path(task.name)
            located = located_records(path, prompt_key, answer_key, prompt_template)
            if chat is not None:
                _check_chat_template(tokenizer)
            for where, text, answer in located:  # every prompt tokenized and measured now, not mid-run
                ids = tuple(tokenizer.encode_prompt(text, chat))
                if len(ids) > max_prompt_len:
                    raise DatasetError(
                        f"{path}: {where}: the prompt has {len(ids)} tokens > data.max_prompt_len="
                        f"{max_prompt_len} ({text[:40]!r}...); raise data.max_prompt_len or drop the record"
                    )
                self.records.append((ids, answer))
        self.tokenizer, self.chat = tokenizer, chat
        self.max_prompt_len = max_prompt_len
        self._order: list[int] = []

    def _next_record(self) -> Prompt:
        if not self._order:
            self._order = list(range(len(self.records)))
            self.rng.shuffle(self._order)
        ids, answer = self.records[self._order.pop()]
        return Prompt(ids, answer, "file")

    def next_batch(self, n: int) -> list[Prompt]:
        if self.synthetic is not None:
            return self.synthetic.make(n, self.rng)
        return [self._next_record() for _ in range(n)]

    def stream(self, seed: int) -> PromptSource:
        """Another stream over the same prompts (the records read once), seeded with ``seed`` and
        drawn apart from this one."""
        other = copy.copy(self)
        other.rng, other._order = random.Random(seed), []
        return other

    def state(self) -> dict:
        """Resumable state (the RNG and the current epoch order)."""
        return {"rng": self.rng.getstate(), "order": list(self._order)}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])
