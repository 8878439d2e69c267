"""Bad input given to `moe-rl train` is refused with one message before anything heavy starts (no
Ray, no model): stored trajectories for offline training, prompt datasets, reward functions. The
recipe values have their own table (tests/unit/config/test_bad_values.py); the run directory and
checkpoints theirs (tests/unit/orchestration/test_run_dir.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("ray", reason="`moe-rl train` runs on Ray")  # e.g. a GPU check machine without Ray

from launch.cli import main
from moe_rl.data.shards import write_shards
from moe_rl.data.synthetic import random_batch
from moe_rl.orchestration.offline import read_offline
from moe_rl.orchestration.preflight import load_checked

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
TINY, DGO = str(RECIPES / "tiny_moe.yaml"), str(RECIPES / "tiny_moe_dgo.yaml")
VOCAB, LAYERS, TOPK, EXPERTS = 16, 2, 2, 8  # recipes/model/tiny_qwen3_moe.yaml


def _shards(folder: Path, seed: int = 0, num_samples: int = 64, break_it=None) -> Path:
    batch = random_batch(
        seed, num_samples, vocab_size=VOCAB, routing=(LAYERS, TOPK, EXPERTS), sampling_mask=True
    )
    if break_it is not None:
        break_it(batch)
    write_shards([batch], folder, max_samples_per_shard=num_samples)
    return folder


def _expert_out_of_range(batch) -> None:
    batch.routed_experts[int(batch.routing_offsets[5]), 1, 0] = EXPERTS


def _token_999(batch) -> None:
    batch.response_ids[int(batch.response_offsets[7])] = 999


def _train(tmp_path: Path, caplog, monkeypatch, *overrides: str, recipe: str = TINY) -> str:
    """`moe-rl train` in this process; returns its one error line (asserting there is one)."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite bad input"))
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        code = main(["train", recipe, f"run.output_dir={tmp_path / 'runs'}", *overrides])  # a later one wins
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1, (code, errors)
    assert "Traceback" not in errors[0]
    return errors[0]


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (_expert_out_of_range, "routed_experts (sample 5, token 0): expert id >= num_experts (MoE layer 1)"),
        (_token_999, "response_ids (sample 7, token 0): token id out of range; got 999; expected 0..15"),
    ],
    ids=["expert-id-8", "token-999"],
)
def test_offline_training_refuses_stored_data_that_fails_validate(
    tmp_path, caplog, monkeypatch, break_it, expected
):
    shards = _shards(tmp_path / "stored", break_it=break_it)
    line = _train(tmp_path, caplog, monkeypatch, f"data.trajectories={shards}", recipe=DGO)
    assert line.startswith(f"{shards}/shard-00000.arrow: {expected}"), line


def test_a_runs_trajectories_folder_is_read_whole_in_step_order(tmp_path):
    folder = tmp_path / "run" / "trajectories"
    for step in (0, 1, 10):
        _shards(folder / f"step_{step:06d}", seed=step)
    config = load_checked(DGO, [f"data.trajectories={folder}"])
    data = read_offline(config, folder)
    assert data.num_samples == 3 * 64
    want = [
        random_batch(s, 64, vocab_size=VOCAB, routing=(LAYERS, TOPK, EXPERTS), sampling_mask=True)
        for s in (0, 1, 10)
    ]
    assert data.response_ids.tolist() == [t for b in want for t in b.response_ids.tolist()]


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: _jsonl(p / "a.jsonl", [b'{"prompt": "1+1=", "answer": "2"}', b'{"prompt": "caf\xe9", "answer": "x"}']),
         "a.jsonl: line 2 is not UTF-8 text"),
        (lambda p: _jsonl(p / "b.jsonl", [b'{"prompt": "1+1=", "solution": "2"}']),
         "b.jsonl: line 1 has no column 'answer' (data.answer_key); columns: ['prompt', 'solution']"),
        (lambda p: _parquet(p / "c.parquet", {"prompt": [[1, 2], [3]], "answer": ["1", "2"]}),
         "c.parquet: row 0, column 'prompt': got [1, 2] (list); expected a string"),
        (lambda p: _parquet(p / "d.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", None]}),
         "d.parquet: row 1, column 'answer': got None (null); expected a string or a number"),
        (lambda p: _jsonl(p / "e.jsonl", [b'{"prompt": "1+1=", "answer": "2"}'] * 50
                          + [json.dumps({"prompt": "9" * 200, "answer": "1"}).encode()]),
         "e.jsonl: line 51: the prompt has 202 tokens > data.max_prompt_len=16"),
        (lambda p: p / "missing.jsonl", "missing.jsonl: no such file (as seen from"),
        (lambda p: (p / "x.jsonl").mkdir() or p / "x.jsonl", "x.jsonl: is a folder, not a file (as seen from"),
    ],
    ids=["jsonl-not-utf8", "jsonl-no-answer", "parquet-list-prompt", "parquet-null-answer", "prompt-too-long",
         "missing-file", "folder-named-jsonl"],
)  # fmt: skip
def test_a_bad_prompt_dataset_is_refused_before_the_run_starts(tmp_path, caplog, monkeypatch, make, expected):
    path = make(tmp_path)
    line = _train(tmp_path, caplog, monkeypatch, f"data.task=file:{path}", "data.reward=exact_match",
                  "model.vocab_size=320")  # fmt: skip
    assert expected in line and str(path.parent) in line, line
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


def _parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_a_reward_function_that_cannot_be_loaded_is_refused_before_the_run_starts(
    tmp_path, caplog, monkeypatch
):
    data = _jsonl(tmp_path / "qa.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}).encode()])
    line = _train(tmp_path, caplog, monkeypatch, f"data.task=file:{data}", "data.reward=no_such_module:score",
                  "model.vocab_size=320")  # fmt: skip
    assert line.startswith("data.reward='no_such_module:score': cannot import no_such_module"), line


def test_an_output_folder_the_machine_refuses_is_one_line(tmp_path, caplog, monkeypatch):
    """A run directory where the file system forbids writing (sysfs): said as such, with the path."""
    line = _train(tmp_path, caplog, monkeypatch, "run.output_dir=/sys/moe_rl_runs")
    assert line.startswith("/sys/moe_rl_runs: ") and line.endswith(
        ("operation not permitted", "permission denied")
    ), line
