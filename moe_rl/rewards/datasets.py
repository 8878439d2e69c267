"""Prompt sources: synthetic tasks or JSONL / Parquet files of prompts and answers."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from moe_rl.rewards.tasks import BOS, EOS, Prompt, get_task


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
    """(prompt, answer) pairs from a `.jsonl` or `.parquet` file; a missing column is an error."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"data.task=file:{path}: expected a .jsonl or .parquet file")
    records = []
    for i, row in enumerate(rows):
        for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key not in row:
                raise ValueError(f"{path}: row {i} has no column {key!r} ({field}); columns: {sorted(row)}")
        records.append((str(row[prompt_key]), str(row[answer_key])))
    if not records:
        raise ValueError(f"{path}: no rows")
    return records


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
                raise ValueError(f"data.task={task}: text prompts need a tokenizer")
            self.records = read_records(Path(name), prompt_key, answer_key)
        elif kind != "synthetic":
            raise ValueError(f"data.task={task!r}: expected `synthetic:<task>` or `file:<path>`")
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
            raise ValueError(
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
