"""`moe-rl train` with an environment whose answer (20 tokens) is longer than what is left of
`env.max_tokens=16` after the model's first turn: with `env.overflow=refuse` the run stops with one
line naming the environment and the lengths. Before, the answer vanished: `rollout/env_tokens` 0
and nothing said. With `truncate` every trajectory keeps what fits and counts: the in-process loop's
run of the same environment (tests/e2e/test_multi_turn.py). The loop's cases one by one:
tests/unit/envs/test_env_overflow.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.multi_turn_env import LONG_ANSWER

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "run.steps=2",
    "rollout.batch_size=16",
    *LONG_ANSWER,
    "logging.progress=false",
    "logging.tensorboard=false",
]


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["train", "recipes/tiny_moe.yaml", *RUN, "run.name=long", f"run.output_dir={tmp_path}", *overrides]
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


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
