"""The math example's CPU recipe (`recipes/examples/math_cpu.yaml`: `math_qwen3_moe.yaml` at toy
size on this machine) for 2 RL steps, run the way its header tells a user: `moe-rl make-model`
writes the random-init checkpoint and the character-level chat tokenizer (its command, in the test's
process), then `moe-rl train`. The whole data path runs: prompt template, chat template with
`enable_thinking: false`, Megatron-engine rollouts, the math-verify reward on decoded responses."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.data.shards import read_trajectories
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rewards.datasets import HFTokenizer
from moe_rl.rewards.functions import math_answer
from moe_rl.rollout.tiny_tokenizer import IM_END
from tests.chat_testing import chat_text

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "recipes/examples/math_cpu.yaml"
DATA = REPO / "recipes" / "examples" / "arithmetic.jsonl"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


def test_math_example_runs_two_steps_on_chat_formatted_prompts(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    from launch.make_model import make_model_command  # what `moe-rl make-model` runs, in this process

    assert make_model_command(str(REPO / EXAMPLE), [f"model.hf_path={folder}"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    args = [f"model.hf_path={folder}", "run.steps=2", "run.name=math", f"run.output_dir={tmp_path}",
            "logging.progress=false", "logging.dump_trajectories=true"]  # fmt: skip
    out = _cli("train", EXAMPLE, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "math"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["reward/mean"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in records)

    config = load_checked(run_dir / "config.yaml")
    assert config.algo == load_checked("recipes/examples/math_qwen3_moe.yaml", paths=False).algo
    # the CPU recipe is the example's data path, only the prompt file and its length bound differ
    shipped = load_checked("recipes/examples/math_qwen3_moe.yaml", paths=False).data
    assert config.data == dataclasses.replace(
        shipped, task=f"file:{DATA.relative_to(REPO)}", max_prompt_len=128
    )
    # every prompt the engine saw is the example's template in the chat template, thinking block off
    assert config.data.chat_template and config.data.chat_template_kwargs == {"enable_thinking": False}
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rendered = {
        chat_text(config.data.prompt_template.format(**row), thinking_off=True): row["answer"] for row in rows
    }
    tokenizer = HFTokenizer(folder, eos_token_id=IM_END)
    batches = list(read_trajectories(run_dir / "trajectories"))
    assert len(batches) == 2
    seen = set()
    for batch in batches:
        for sample in batch.samples():
            text = tokenizer.hf.decode(sample.prompt_ids.tolist())
            assert text in rendered, text
            assert sample.prompt_ids.tolist() == tokenizer.hf.encode(text, add_special_tokens=False)
            # the stored reward is math-verify's on the decoded response
            response = tokenizer.decode_response(sample.response_ids.tolist())
            assert sample.reward == math_answer(response, rendered[text]), (response, rendered[text])
            seen.add(text)
    assert len(seen) == 2 * 16 // 4  # 4 prompts a step, 36 in the file: no repeat within an epoch
