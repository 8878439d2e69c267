"""`moe-rl make-model` refuses what it cannot make with one line naming the value, before torch
loads and before anything is written (its success path: tests/e2e/test_math_example.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from launch.cli import main

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
MATH_CPU = str(RECIPES / "examples" / "math_cpu.yaml")


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        (str(RECIPES / "deepseek_v3.yaml"), [],
         "model.family=deepseek_v3 (attention mla): a checkpoint can be made from the recipe alone only for "
         "family qwen3_moe with attention gqa"),
        (MATH_CPU, ["model.eos_token_id=2"],
         "model.eos_token_id=2: the character-level chat tokenizer ends a turn with <|im_end|> = 3; "
         "set model.eos_token_id=3"),
        (MATH_CPU, ["model.vocab_size=64"],
         "model.vocab_size=64: the character-level chat tokenizer has 102 tokens; set model.vocab_size >= 102"),
        (str(RECIPES / "tiny_moe.yaml"), ["model.hf_path=null"],
         "model.hf_path=null and no --out: say where the checkpoint goes"),
    ],
    ids=["mla-family", "eos", "vocab", "nowhere"],
)  # fmt: skip
def test_make_model_refuses_with_one_line(tmp_path, caplog, recipe, overrides, expected):
    out = [] if overrides == ["model.hf_path=null"] else ["--out", str(tmp_path / "model")]
    with caplog.at_level(logging.ERROR):
        code = main(["make-model", recipe, *overrides, *out])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert (code, errors) == (2, [expected])
    assert not (tmp_path / "model").exists()


def test_make_model_keeps_a_folder_that_holds_files(tmp_path, caplog):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_text("mine")
    with caplog.at_level(logging.ERROR):
        code = main(["make-model", MATH_CPU, "--out", str(folder)])
    assert code == 2
    assert (
        caplog.records[-1].getMessage()
        == f"{folder} exists and is not an empty folder; pass --force to write into it"
    )
    assert [p.name for p in folder.iterdir()] == ["weights.bin"]
