"""Prompt files: every bad row is a ValueError naming the file, the row (or line) and the column."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.errors import UserError
from moe_rl.rewards import ByteTokenizer, PromptSource
from moe_rl.rewards.datasets import read_records


def _jsonl(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines))
    return path


def _parquet(tmp_path: Path, columns: dict[str, pa.Array]) -> Path:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table(columns), path)
    return path


def _row(prompt: object, answer: object) -> bytes:
    return json.dumps({"prompt": prompt, "answer": answer}).encode()


def test_good_files_give_text_pairs_and_numbers_as_answers(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [_row("1+1=", "2"), b"", _row("2+2=", 4), _row("half", 0.5)])
    assert read_records(path, "prompt", "answer") == [("1+1=", "2"), ("2+2=", "4"), ("half", "0.5")]
    table = {"prompt": pa.array(["1+1=", "2+3="]), "answer": pa.array([2, 5]), "extra": pa.array([[1], [2]])}
    assert read_records(_parquet(tmp_path, table), "prompt", "answer") == [("1+1=", "2"), ("2+3=", "5")]


JSONL_CASES = {
    "not UTF-8": (
        [_row("a", "1"), b'{"prompt": "caf\xe9", "answer": "1"}'],
        "line 2 is not UTF-8 text (byte offset 15 in the line: b'\\xe9')",
    ),
    "not JSON": (
        [_row("a", "1"), b"", b'{"prompt": "a",'],
        "line 3 is not valid JSON: Expecting property name",
    ),
    "not an object": ([b'["a", "1"]'], "line 1 is a JSON list; expected an object"),
    "null answer": (
        [_row("a", "1"), _row("b", None)],
        "line 2, column 'answer': got None (null); expected a string or a number",
    ),
    "list prompt": ([_row([1, 2], "3")], "line 1, column 'prompt': got [1, 2] (list); expected a string"),
    "number prompt": ([_row(7, "3")], "line 1, column 'prompt': got 7 (int); expected a string"),
    "bool answer": (
        [_row("a", True)],
        "line 1, column 'answer': got True (bool); expected a string or a number",
    ),
    "missing answer": (
        [b'{"prompt": "a", "solution": "1"}'],
        "line 1 has no column 'answer' (data.answer_key); columns: ['prompt', 'solution']",
    ),
}


@pytest.mark.parametrize(("lines", "message"), JSONL_CASES.values(), ids=JSONL_CASES.keys())
def test_bad_jsonl_lines_are_named(tmp_path: Path, lines: list[bytes], message: str) -> None:
    path = _jsonl(tmp_path, lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        read_records(path, "prompt", "answer")


PARQUET_CASES = {
    "list prompt column": (
        {"prompt": pa.array([[1, 2], [3]]), "answer": pa.array(["3", "3"])},
        "row 0, column 'prompt': got [1, 2] (list); expected a string",
    ),
    "null answer": (
        {"prompt": pa.array(["a", "b"]), "answer": pa.array(["1", None])},
        "row 1, column 'answer': got None (null); expected a string or a number",
    ),
    "struct answer": (
        {"prompt": pa.array(["a"]), "answer": pa.array([{"value": 1}])},
        "row 0, column 'answer': got {'value': 1} (dict); expected a string or a number",
    ),
    "missing answer column": (
        {"prompt": pa.array(["a"]), "solution": pa.array(["1"])},
        "no column 'answer' (data.answer_key); columns present: ['prompt', 'solution']",
    ),
    "missing prompt column": (
        {"question": pa.array(["a"]), "answer": pa.array(["1"])},
        "no column 'prompt' (data.prompt_key); columns present: ['question', 'answer']",
    ),
}


@pytest.mark.parametrize(("columns", "message"), PARQUET_CASES.values(), ids=PARQUET_CASES.keys())
def test_bad_parquet_rows_and_columns_are_named(tmp_path: Path, columns: dict, message: str) -> None:
    path = _parquet(tmp_path, columns)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        read_records(path, "prompt", "answer")


def test_unreadable_parquet_and_empty_files(tmp_path: Path) -> None:
    path = _parquet(tmp_path, {"prompt": pa.array(["a"]), "answer": pa.array(["1"])})
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a readable Parquet file: ")):
        read_records(path, "prompt", "answer")
    empty = _jsonl(tmp_path, [b"", b"  "])
    with pytest.raises(ValueError, match=re.escape(f"{empty}: no rows")):
        read_records(empty, "prompt", "answer")


def test_a_prompt_of_exactly_max_prompt_len_tokens_is_kept_and_one_more_is_refused(tmp_path: Path) -> None:
    # the byte tokenizer's prompt is BOS + one id a byte + EOS: "abcdef" is 1 + 6 + 1 = 8 tokens
    path = _jsonl(tmp_path, [_row("abcdef", "1")])
    source = PromptSource(f"file:{path}", seed=0, tokenizer=ByteTokenizer(), max_prompt_len=8)
    assert len(source.next_batch(1)[0].ids) == 8
    longer = _jsonl(tmp_path, [_row("abcdef", "1"), _row("abcdefg", "2")])  # 1 + 7 + 1 = 9 tokens
    with pytest.raises(
        UserError, match=re.escape(f"{longer}: line 2: the prompt has 9 tokens > data.max_prompt_len=8")
    ):
        PromptSource(f"file:{longer}", seed=0, tokenizer=ByteTokenizer(), max_prompt_len=8)
