"""The math example (`recipes/examples/math_qwen3_moe.yaml`) for 3 RL steps through `moe-rl train`
on its CPU twin: the recipe as shipped, with a toy Qwen3-MoE checkpoint and a character-level chat
tokenizer made in the test (`model.hf_path`), `tests/data/arithmetic.jsonl` as the prompt file and
a one-process layout. The whole data path runs: prompt template, chat template with
`enable_thinking: false`, Megatron-engine rollouts, the math-verify reward on decoded responses."""

from __future__ import annotations

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
from tests.unit.rewards.chat_tokenizer import IM_END, chat_text, write_chat_tokenizer

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "recipes/examples/math_qwen3_moe.yaml"
DATA = REPO / "tests" / "data" / "arithmetic.jsonl"

CPU_TWIN = [
    # Qwen3-MoE layer types at toy size, over the test tokenizer's vocabulary (<|im_end|> ends a turn)
    "model.vocab_size=128", "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.head_dim=16", "model.ffn_hidden_size=128",
    "model.moe_ffn_hidden_size=32", "model.num_experts=8", "model.moe_router_topk=2",
    "model.max_position_embeddings=256", f"model.eos_token_id={IM_END}",
    # one trainer process and one Megatron engine on this machine
    "run.device=auto", "parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=1",
    "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false",
    "parallel.trainer_world_size=1", "cluster.nodes=1", "cluster.trainer_nodes=1", "cluster.rollout_nodes=0",
    "cluster.gpus_per_node=0", "rollout.engine=megatron", "rollout.num_engines=1", "rollout.batch_size=16",
    "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_model_len=256",
    "trainer.precision=fp32", "trainer.recompute_activations=false", "trainer.max_tokens_per_microbatch=2048",
    # the shipped arithmetic problems; chat-rendered prompts are ~110 characters = tokens
    f"data.task=file:{DATA}", "data.max_prompt_len=128",
]  # fmt: skip


def _model_folder(folder: Path) -> Path:
    """A random-init Qwen3-MoE checkpoint of the twin's shape, with the chat tokenizer beside it."""
    from moe_rl.rollout.tiny_hf import make_tiny_qwen3_moe, qwen3_moe_kwargs

    model = load_checked(EXAMPLE, CPU_TWIN, paths=False).model  # the folder is made from it
    make_tiny_qwen3_moe(folder, seed=0, eos_token_id=IM_END, **qwen3_moe_kwargs(model))
    return write_chat_tokenizer(folder)


def test_math_example_runs_three_steps_on_chat_formatted_prompts(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model")
    args = [*CPU_TWIN, f"model.hf_path={folder}", "run.steps=3", "run.name=math", f"run.output_dir={tmp_path}",
            "logging.progress=false", "logging.dump_trajectories=true"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", EXAMPLE, *args],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "math"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(r["reward/mean"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in records)

    # every prompt the engine saw is the example's template in the chat template, thinking block off
    config = load_checked(run_dir / "config.yaml")
    assert config.data.chat_template and config.data.chat_template_kwargs == {"enable_thinking": False}
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rendered = {
        chat_text(config.data.prompt_template.format(**row), thinking_off=True): row["answer"] for row in rows
    }
    tokenizer = HFTokenizer(folder, eos_token_id=IM_END)
    batches = list(read_trajectories(run_dir / "trajectories"))
    assert len(batches) == 3
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
    assert len(seen) == 3 * 16 // 4  # 4 prompts a step, 36 in the file: no repeat within an epoch
