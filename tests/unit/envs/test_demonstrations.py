"""Demonstrations for `moe-rl sft` (`moe_rl.orchestration.sft`): the calculator writes a call of the
prompt's product and then answers with the result, in the layout of a multi-turn trajectory; JSONL
demonstrations (text or token ids) are read with their file and line in every refusal; the recipe
`moe-rl sft` runs is an offline run in which every demonstration weighs 1."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_rl.algo.objectives import sft_weights
from moe_rl.config import ConfigError
from moe_rl.envs.calculator import CALL, END_CALL, END_RESULT, RESULT, CalculatorEnv, evaluate, tokens_to_expr
from moe_rl.errors import EnvError, UserError
from moe_rl.orchestration.preflight import load_checked
from moe_rl.orchestration.sft import build_demonstrations, sft_overrides
from moe_rl.rewards.tasks import EOS, TIMES
from moe_rl.run_dir import MANIFEST, init_checkpoint, write_manifest

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
TOOLS = RECIPES / "tiny_moe_tools.yaml"


def _sft(*overrides: str):
    return load_checked(TOOLS, sft_overrides(TOOLS, list(overrides)), paths=False)


def test_the_calculator_demonstrates_a_call_then_the_result():
    env = CalculatorEnv(open_call=True)
    prompt = [1, 7, 5, TIMES, 4, 6, EOS, CALL]  # 42 * 13, the call opened
    call = env.demonstrate(prompt)
    assert call == [7, 5, TIMES, 4, 6, END_CALL]
    assert CalculatorEnv().demonstrate(prompt[:-1]) == [CALL, *call]  # a call it must open itself
    answer = env.demonstrate([*prompt, *call, RESULT, 8, 5, 9, END_RESULT])
    assert answer == [8, 5, 9, EOS]


def test_environment_demonstrations_are_trajectories_of_full_reward():
    config = _sft("sft.num_demonstrations=64")
    assert (
        config.sft.demonstrations == "env" and config.run.mode == "offline" and config.algo.objective == "sft"
    )
    batch = build_demonstrations(config)
    assert batch.num_samples == 64 and batch.group_ids.tolist() == list(range(64))
    assert batch.rewards.tolist() == [1.0] * 64  # taken as correct responses (SFT does not read them)
    assert torch.equal(sft_weights(batch.rewards, batch.group_ids), torch.ones(64))  # every one weighs 1
    for sample in batch.samples():
        prompt, response = sample.prompt_ids.tolist(), sample.response_ids.tolist()
        assert prompt[-1] == CALL
        product = evaluate(tokens_to_expr(prompt[1 : prompt.index(EOS)]))
        # the model's call, the tool's result (not trained on), the model's answer
        end = response.index(END_CALL)
        assert response[: end + 1] == [*prompt[1 : prompt.index(EOS)], END_CALL]
        result = response[end + 1 : response.index(END_RESULT) + 1]
        assert result[0] == RESULT and evaluate(tokens_to_expr(result[1:-1])) == product
        assert response[len(result) + end + 1 :] == [*result[1:-1], EOS]
        sampled = sample.sampled.tolist()
        assert sampled == [True] * (end + 1) + [False] * len(result) + [True] * (len(result) - 1)


def test_jsonl_demonstrations_and_their_refusals(tmp_path):
    good = tmp_path / "demos.jsonl"
    longest = {"prompt_ids": [1] * 16, "response_ids": [2]}  # data.max_prompt_len=16; 17 is refused below
    rows = [{"prompt_ids": [1, 4, 5], "response_ids": [6, 2]}] * 63 + [longest]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = load_checked(
        RECIPES / "tiny_moe.yaml", sft_overrides(RECIPES / "tiny_moe.yaml", [f"sft.demonstrations=file:{good}"]),
        paths=False,
    )  # fmt: skip
    batch = build_demonstrations(config)
    assert batch.num_samples == 64 and batch.sampled is None
    assert batch.sample(0).response_ids.tolist() == [6, 2]
    assert batch.sample(63).prompt_ids.tolist() == [1] * 16
    for row, expected in [
        ({"prompt_ids": [1, 99], "response_ids": [2]}, "line 2: `prompt_ids` has ids outside [0, 16)"),
        ({"prompt": "x"}, "line 2: expected text `prompt` and `response`, or `prompt_ids` and `response_ids`"),
        ({"prompt_ids": [1] * 17, "response_ids": [2]}, "line 2: the prompt has 17 tokens > data.max_prompt_len=16"),
        ({"prompt": "12", "response": "3"}, "line 2: text demonstrations need a tokenizer, and data.task="),
    ]:  # fmt: skip
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(UserError) as caught:
            build_demonstrations(replace(config, sft=replace(config.sft, demonstrations=f"file:{bad}")))
        assert str(caught.value).startswith(f"{bad}: {expected}"), str(caught.value)


def test_environment_demonstrations_fit_a_prompt_of_exactly_data_max_prompt_len():
    # a calculator prompt is BOS a1 a2 * b1 b2 EOS CALL: 8 tokens
    overrides = ("sft.num_demonstrations=8", "rollout.batch_size=8")
    batch = build_demonstrations(_sft(*overrides, "data.max_prompt_len=8"))
    assert {len(sample.prompt_ids) for sample in batch.samples()} == {8}
    with pytest.raises(
        EnvError, match=r"context of 8 tokens \(trajectory 0\); expected 1 to data.max_prompt_len=7"
    ):
        build_demonstrations(_sft(*overrides, "data.max_prompt_len=7"))


def test_sft_needs_demonstrations_and_a_plain_run_refuses_them():
    with pytest.raises(ConfigError, match="sft.demonstrations is not set and the recipe has no environment"):
        sft_overrides(RECIPES / "tiny_moe.yaml", [])
    with pytest.raises(
        ConfigError, match="sft.demonstrations=env: demonstrations are what `moe-rl sft RECIPE`"
    ):
        load_checked(TOOLS, ["sft.demonstrations=env"], paths=False)


def test_a_missing_starting_checkpoint_is_refused_before_the_run(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_checked(TOOLS, [f"model.init_from={tmp_path}"])
    assert str(caught.value).startswith(
        f"model.init_from={tmp_path}: neither a run directory with checkpoints/ nor a checkpoint folder with trainer/"
    )
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="the run has no checkpoint yet"):
        load_checked(TOOLS, [f"model.init_from={tmp_path}"])


def _sealed(run: Path, step: int) -> Path:
    folder = run / "checkpoints" / f"step_{step:06d}"
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer" / "__0_0.distcp").write_bytes(bytes(range(256)))
    write_manifest(folder)  # what a save writes last
    return folder


def test_a_run_directory_or_one_sealed_checkpoint_folder_is_a_starting_checkpoint(tmp_path):
    older, newer = _sealed(tmp_path, 1), _sealed(tmp_path, 2)
    load_checked(TOOLS, [f"model.init_from={tmp_path}"])
    assert init_checkpoint(tmp_path) == newer / "trainer"  # a run directory: its newest checkpoint
    load_checked(TOOLS, [f"model.init_from={older}"])
    assert init_checkpoint(older) == older / "trainer"  # one folder: that checkpoint, not the run's newest
    (older / MANIFEST).unlink()  # a save cut short before its seal
    with pytest.raises(ConfigError) as caught:
        load_checked(TOOLS, [f"model.init_from={older}"])
    assert str(caught.value).startswith(
        f"model.init_from={older}: the checkpoint is not usable: no manifest.json (the save did not finish)"
    )
