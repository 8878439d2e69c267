"""`moe-rl train` with an environment whose answer (20 tokens) is longer than what is left of
`env.max_tokens=16` after the model's first turn: with `env.overflow=truncate` every trajectory
keeps what fits (`rollout/env_tokens` > 0) and counts (`env/truncated_share` 1.0); with `refuse`
the run stops with one line naming the environment and the lengths. Before, the answer vanished:
`rollout/env_tokens` 0 and nothing said. The loop's cases one by one:
tests/unit/envs/test_env_overflow.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ANSWER = [10 + i % 10 for i in range(20)]  # digit tokens of the tool vocabulary
RUN = ["run.steps=2", "rollout.batch_size=16", "model.vocab_size=32", "data.task=synthetic:tool_multiply",
       "env.name=tests.e2e.multi_turn_env:ScriptedEnv", f"env.kwargs={{observation: {ANSWER}}}",
       "env.max_turns=3", "env.max_tokens=16", "logging.progress=false", "logging.tensorboard=false"]  # fmt: skip


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["train", "recipes/tiny_moe.yaml", *RUN, "run.name=long", f"run.output_dir={tmp_path}", *overrides]
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


def test_a_long_answer_is_truncated_and_counted(tmp_path):
    out = _train(tmp_path, "env.overflow=truncate")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["env/truncated_share"] == 1.0 and r["env/turns_per_trajectory"] == 2.0
        # after a first turn of 1..8 tokens, 7..14 of the answer fit in each of the 16 trajectories
        assert 16 * 7 <= r["rollout/env_tokens"] <= 16 * 14
        assert r["rollout/env_tokens"] + r["rollout/sampled_tokens"] == 16 * 16  # every budget filled


def test_a_long_answer_is_refused_with_one_line(tmp_path):
    out = _train(tmp_path, "env.overflow=refuse")
    errors = [line for line in out.stderr.splitlines() if " E " in line]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    line = errors[0].split(" E moe_rl.cli: ", 1)[1]
    assert line.startswith(
        "env tests.e2e.multi_turn_env:ScriptedEnv: an answer of 20 tokens (trajectory 0, after model turn 1) "
        "does not fit env.max_tokens=16 with "
    ), line
    assert line.split(" (traceback: ")[0].endswith(
        "raise env.max_tokens, make the answers shorter, or set env.overflow=truncate"
    ), line
    assert "Traceback" not in out.stderr
