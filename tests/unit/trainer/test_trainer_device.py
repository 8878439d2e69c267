"""One device per process: the worker and the Megatron engine move data to their device once, at
their boundary, create every tensor of a pass there, hand the model only tensors on its device and
give back CPU results. Meaningful on a CPU-only machine too (see `device_audit`)."""

from __future__ import annotations

import os

import pytest
import torch
from device_audit import FactoryAudit, ModelInputAudit, tensors_of
from trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE, micro_batches, tiny_recipe

from moe_rl.data.errors import TrajectoryError
from moe_rl.data.trajectory import Sample, TrajectoryBatch
from moe_rl.device import Machine, check_process_device, process_device, resolve_device
from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.sampler import sample
from moe_rl.trainer.worker import TrainerWorker

pytestmark = pytest.mark.usefixtures("device")


def test_the_boundary_moves_every_tensor_of_a_micro_batch():
    """`TrainMicroBatch.to` leaves no field behind (a missed field would stay on the CPU)."""
    config = tiny_recipe()
    (mb, *_) = micro_batches(0, 6, config.model)
    mb.old_logp = torch.zeros_like(mb.advantages)
    mb.old_entropy = torch.zeros_like(mb.advantages)
    mb.recorded_routing = mb.micro.routed_experts.long()
    found = tensors_of(mb)
    assert {"micro.input_ids", "micro.routed_experts", "micro.sampling_mask_ids", "recorded_routing"} <= {
        name for name, _ in found
    }
    mb = mb.to("meta")
    assert [name for name, t in tensors_of(mb) if t.device.type != "meta"] == []
    assert mb.seq_ids.device.type == "meta" and mb.sample_of_token.device.type == "meta"


def test_a_worker_step_creates_its_tensors_on_the_worker_device(device):
    worker = TrainerWorker(tiny_recipe())
    assert worker.device.type == device.type == process_device().type
    mbs = micro_batches(1, 12, worker.config.model, max_tokens=48)  # CPU, as from a trajectory
    inputs = ModelInputAudit(worker.model)
    with FactoryAudit() as audit:
        mbs, old = worker.compute_old_logp(mbs)
        first = worker.train_step(mbs[: len(mbs) // 2])
        second = worker.train_step(mbs[len(mbs) // 2 :])
    inputs.remove()
    assert audit.violations == []
    assert inputs.calls >= 2 * len(mbs) and inputs.devices == {next(worker.model.parameters()).device}
    assert all(mb.device.type == device.type and mb.old_logp.device.type == device.type for mb in mbs)
    for metrics in (old, first, second):
        assert all(isinstance(value, float) for value in metrics.values())
    assert all(t.device.type == device.type for _, t in iter_hf_weights(worker.model))


def test_engine_and_diagnostics_create_their_tensors_on_their_device(device):
    from moe_rl.diagnostics.measure import MeasureParams, measure
    from moe_rl.rollout.megatron_engine import MegatronEngine

    config = load_checked(
        TINY_RECIPE, [*TINY_MODEL_OVERRIDES, "rollout.quant=bf16", "rollout.top_p=0.9", "rollout.top_k=8"]
    )
    engine = MegatronEngine(config)
    assert engine.device.type == device.type and engine.generator.device.type == device.type
    assert engine.capabilities.device == device.type
    worker = TrainerWorker(config)
    engine.update_weights(iter_hf_weights(worker.model), version=1)
    prompts = [[1, 3, 5, 7], [2, 4, 6]]
    inputs = ModelInputAudit(engine.model)
    with FactoryAudit() as audit:
        batch = engine.generate(prompts, SamplingSpec(top_k=8, top_p=0.9, max_new_tokens=4, n=2, seed=0))
        greedy = engine.generate(prompts, SamplingSpec(temperature=0.0, max_new_tokens=3))
        found = measure(worker.model, batch, engine.capabilities, MeasureParams.from_config(config))
    inputs.remove()
    assert audit.violations == []
    assert inputs.devices == {engine.device}
    for produced in (batch, greedy):  # trajectories are CPU tensors on the wire
        assert all(t.device.type == "cpu" for _, t in tensors_of(produced))
    assert found["r3+ksm"]["kl_k3"] <= 1e-9  # bf16: engine and trainer hold the same weights


def test_sampler_refuses_a_generator_of_another_device():
    logits = torch.randn(2, 8, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu, the logits on meta"):
        sample(logits, generator=torch.Generator())


def test_trajectories_refuse_device_tensors():
    ids = torch.tensor([1, 2], dtype=torch.int32)
    bad = Sample(ids, ids.to("meta"), torch.zeros(2), 0.0, 0, "stop", [(0, 0)])
    with pytest.raises(TrajectoryError, match=r"response_ids \(sample 0\).*live on the CPU.*meta"):
        TrajectoryBatch.from_samples([bad], engine="megatron", quant_recipe="bf16", policy_version=0)


def test_run_device_must_match_what_the_process_sees():
    here = process_device().type
    assert check_process_device("auto").type == here
    assert check_process_device(here).type == here
    other = "cuda" if here == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"run.device={other} but this process computes on {here}"):
        check_process_device(other)
    with pytest.raises(ValueError, match="run.device='gpu'; expected one of auto, cpu, cuda"):
        resolve_device("gpu", Machine(cuda=False))


def test_a_cpu_command_hides_the_gpus_and_sees_none(monkeypatch):
    """`machine_here`: run.device=cpu hides the GPUs (for torch and the processes started after)
    and reports no CUDA, without asking torch; otherwise it is what torch detects."""
    from moe_rl import device as device_module

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(device_module.Machine, "detect", classmethod(lambda cls: pytest.fail("detected")))
    assert device_module.machine_here("cpu") == Machine(cuda=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    detected = Machine(cuda=True, capability=(9, 0))
    monkeypatch.setattr(device_module.Machine, "detect", classmethod(lambda cls: detected))
    for run_device in ("auto", "cuda"):
        assert device_module.machine_here(run_device) is detected
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
