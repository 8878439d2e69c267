"""Prompt formatting of dataset files: `data.prompt_template`, `data.chat_template` (with a system
prompt and template kwargs), the reward on the decoded response, and the errors naming the field,
the record, the file or the tokenizer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.config import ConfigError
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rewards import ByteTokenizer, PromptSource, RewardScorer
from moe_rl.rewards.datasets import ChatFormat, DatasetError, HFTokenizer, read_records
from moe_rl.rewards.registry import build_prompt_source, build_scorer
from moe_rl.rewards.tasks import EOS, Prompt
from moe_rl.rollout.tiny_tokenizer import IM_END, write_chat_tokenizer
from tests.chat_testing import chat_text

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "tiny_moe.yaml"
QUESTIONS = [{"question": "17+25", "answer": "42"}, {"question": "6*7", "answer": 42}]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(chat_folder: Path) -> HFTokenizer:
    return HFTokenizer(chat_folder, eos_token_id=IM_END)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_template_fills_fields_of_jsonl_and_parquet_records(tmp_path: Path) -> None:
    rows = [{"question": "17+25", "n": 2, "answer": "42"}, {"question": "6*7", "n": 10, "answer": 42}]
    template = "Q{n:>3}: {question}\nAnswer with {{}}:"
    expected = [("Q  2: 17+25\nAnswer with {}:", "42"), ("Q 10: 6*7\nAnswer with {}:", "42")]
    assert read_records(_jsonl(tmp_path / "q.jsonl", rows), "prompt", "answer", template) == expected
    parquet = tmp_path / "q.parquet"
    pq.write_table(
        pa.table({k: [r[k] for r in rows] for k in ("question", "n")} | {"answer": ["42", "42"]}), parquet
    )
    assert read_records(parquet, "prompt", "answer", template) == expected
    # the byte tokenizer encodes the filled text (BOS bytes EOS)
    source = PromptSource(f"file:{parquet}", seed=0, tokenizer=ByteTokenizer(), prompt_template=template)
    prompt = source.next_batch(1)[0]
    assert ByteTokenizer().decode(prompt.ids) in {text for text, _ in expected} and prompt.ids[-1] == EOS


def test_chat_template_renders_system_prompt_and_passes_kwargs(
    tmp_path: Path, tokenizer: HFTokenizer
) -> None:
    data = _jsonl(tmp_path / "q.jsonl", QUESTIONS[:1])
    template = "Solve: {question}"
    for chat, system, thinking_off in [
        (ChatFormat(), None, False),
        (ChatFormat("Be brief.", {"enable_thinking": False}), "Be brief.", True),
    ]:
        source = PromptSource(
            f"file:{data}", seed=0, tokenizer=tokenizer, prompt_template=template, chat=chat
        )
        (prompt,) = source.next_batch(1)
        text = chat_text("Solve: 17+25", system=system, thinking_off=thinking_off)
        # exactly the rendered turns: no BOS added again, no id appended after the assistant opening
        assert list(prompt.ids) == tokenizer.hf.encode(text, add_special_tokens=False)
        assert tokenizer.hf.decode(list(prompt.ids)) == text


def test_recipe_keys_reach_the_prompt_source(tmp_path: Path, chat_folder: Path) -> None:
    data = _jsonl(tmp_path / "q.jsonl", QUESTIONS[:1])
    config = load_checked(
        TINY,
        [
            f"data.task=file:{data}",
            "data.reward=math",
            f"model.hf_path={chat_folder}",
            "model.vocab_size=128",
            f"model.eos_token_id={IM_END}",
            "data.max_prompt_len=100",
            'data.prompt_template="Solve: {question}"',
            "data.chat_template=true",
            "data.system_prompt=Be brief.",
            "data.chat_template_kwargs.enable_thinking=false",
        ],
        paths=False,
    )  # fmt: skip  (the folder holds a tokenizer only, no weights)
    (prompt,) = build_prompt_source(config).next_batch(1)
    text = chat_text("Solve: 17+25", system="Be brief.", thinking_off=True)
    assert HFTokenizer(chat_folder).hf.decode(list(prompt.ids)) == text
    # the math reward reads the decoded response, cut at model.eos_token_id, special tokens dropped
    scorer = build_scorer(config)
    encode = HFTokenizer(chat_folder).hf.encode
    right = encode("17+25 is \\boxed{42}", add_special_tokens=False)
    assert scorer.score(prompt, [*right, IM_END, *encode("43")]) == 1.0
    assert scorer.score(prompt, encode("<think>\n\n</think>\n\nIt is 42", add_special_tokens=False)) == 1.0
    assert scorer.score(prompt, encode("\\boxed{41}", add_special_tokens=False)) == 0.0


def test_exact_match_sees_the_response_without_the_end_of_turn(tokenizer: HFTokenizer) -> None:
    scorer = RewardScorer("exact_match", tokenizer=tokenizer)
    prompt = Prompt(ids=(1,), answer="42")
    ids = tokenizer.hf.encode("42", add_special_tokens=False)
    assert tokenizer.decode([*ids, IM_END]) == "42<|im_end|>"
    assert scorer.score(prompt, [*ids, IM_END]) == 1.0
    assert scorer.score(prompt, [*ids, *tokenizer.hf.encode("1", add_special_tokens=False)]) == 0.0


def test_a_template_field_missing_from_a_record_names_field_record_and_file(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "q.jsonl", [*QUESTIONS, {"problem": "1+1", "answer": "2"}])
    with pytest.raises(DatasetError) as err:
        PromptSource(f"file:{data}", seed=0, tokenizer=ByteTokenizer(), prompt_template="Solve: {question}")
    assert str(err.value) == (
        f"{data}: line 3 has no column 'question' (data.prompt_template); columns: ['answer', 'problem']"
    )
    parquet = tmp_path / "q.parquet"
    pq.write_table(pa.table({"problem": ["1+1"], "answer": ["2"]}), parquet)
    with pytest.raises(
        DatasetError, match=re.escape(f"{parquet}: no column 'question' (data.prompt_template)")
    ):
        read_records(parquet, "prompt", "answer", "Solve: {question}")
    bad_spec = _jsonl(tmp_path / "spec.jsonl", QUESTIONS)
    with pytest.raises(
        DatasetError, match=re.escape(f"{bad_spec}: line 1: data.prompt_template='{{question:d}}'")
    ):
        read_records(bad_spec, "prompt", "answer", "{question:d}")


def test_chat_template_without_one_names_the_tokenizer(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    plain = write_chat_tokenizer(tmp_path / "plain", chat_template=None)
    for tokenizer, name in [
        (ByteTokenizer(), "the byte tokenizer"),
        (HFTokenizer(plain), f"the tokenizer of model.hf_path={plain}"),
    ]:
        with pytest.raises(DatasetError) as err:
            PromptSource(
                f"file:{data}", seed=0, tokenizer=tokenizer, prompt_key="question", chat=ChatFormat()
            )
        assert str(err.value).startswith(
            f"data.chat_template=true needs a tokenizer with a chat template; {name}"
        )


def test_a_chat_template_that_refuses_the_prompt_fails_when_the_source_is_built(tmp_path: Path) -> None:
    refusing = "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    folder = write_chat_tokenizer(tmp_path / "refusing", chat_template=refusing)
    data = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    with pytest.raises(
        DatasetError, match=re.escape(f"of the tokenizer of model.hf_path={folder} failed")
    ) as err:
        PromptSource(f"file:{data}", seed=0, tokenizer=HFTokenizer(folder), prompt_key="question",
                     chat=ChatFormat("Be brief."))  # fmt: skip
    assert "no system role" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.chat_template=true"], "data.chat_template formats the prompts of a dataset file"),
        (
            ['data.prompt_template="Q: {question}"'],
            "data.prompt_template formats the prompts of a dataset file",
        ),
        (
            ["data.task=file:q.jsonl", "data.system_prompt=Hi"],
            "data.system_prompt is used by the chat template",
        ),
        (
            ["data.task=file:q.jsonl", "data.chat_template_kwargs.enable_thinking=false"],
            "data.chat_template_kwargs is used by the chat template",
        ),
        (["data.task=file:q.jsonl", "data.prompt_template=\\boxed{}"], "`{}` is not a field name"),
        (["data.task=file:q.jsonl", "data.prompt_template=Solve {q"], "is not a format string"),
        (["data.task=file:q.jsonl", "data.prompt_template=Solve it"], "names no record field"),
    ],
)
def test_prompt_format_keys_are_checked_with_the_recipe(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_checked(TINY, overrides)


def test_train_refuses_a_record_without_the_template_field_in_one_line(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "q.jsonl", [*QUESTIONS, {"problem": "1+1", "answer": "2"}])
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", str(TINY), f"data.task=file:{data}", "data.reward=math",
         "model.vocab_size=320", 'data.prompt_template="Solve: {question}"', f"run.output_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if " E " in x]
    assert line.endswith(
        f"{data}: line 3 has no column 'question' (data.prompt_template); columns: ['answer', 'problem']"
    )


def test_the_math_example_passes_config_check_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    example = "recipes/examples/math_qwen3_moe.yaml"
    # its dataset and checkpoint are the user's: absent here, so named, unless left to the cluster
    assert main(["config", "check", str(REPO / example)]) == 1
    assert "data.task=file:data/math_train.jsonl: no such file" in capsys.readouterr().out
    assert main(["config", "check", str(REPO / example), "--skip-path-checks"]) == 0
    assert main(["plan", str(REPO / example), "--skip-path-checks"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    d = load_checked(REPO / example, paths=False).data
    assert (d.task.startswith("file:"), d.reward, d.chat_template) == (True, "math", True)
    assert d.chat_template_kwargs == {"enable_thinking": False}
    assert d.prompt_template.format(question="6*7") == (
        "6*7\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
