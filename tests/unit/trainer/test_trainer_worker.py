"""TrainerWorker: the RL passes with the stability stack, checkpoints with exact resume, on each
device (the worker gets CPU micro-batches, as from a trajectory, and moves them itself)."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch
from trainer_testing import assert_same, micro_batches, tiny_recipe

from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.trainer.worker import TrainerWorker

pytestmark = pytest.mark.usefixtures("device")


def _batches(config, seed: int = 0, **kwargs):
    return micro_batches(seed, 12, config.model, max_tokens=48, **kwargs)


@pytest.fixture(scope="module")
def stack_worker():
    return TrainerWorker(tiny_recipe())


def test_stability_stack_step(stack_worker):
    worker = stack_worker
    assert worker.config.algo.routing_replay == "r3" and worker.config.algo.objective == "espo"
    mbs, old = worker.compute_old_logp(_batches(worker.config))
    assert all(mb.old_logp is not None and mb.old_entropy is not None for mb in mbs)
    assert {"old/kl_k3", "old/ess_token", "old/routing_agreement"} <= set(old)
    metrics = worker.train_step(mbs)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert metrics["train/update_ok"] == 1.0
    # zero update: the first logp pass sees the weights of the old-logp pass
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/routing_agreement"] == pytest.approx(old["old/routing_agreement"], abs=1e-6)
    assert {"train/icepop_masked_frac", "train/opsm_masked_token_frac"} <= set(metrics)
    second = worker.train_step(mbs)
    assert second["train/ratio_mean"] != pytest.approx(1.0, abs=1e-7)


def test_hf_weights_of_a_worker_stream_names(stack_worker):
    names = [name for name, _ in iter_hf_weights(stack_worker.model)]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names


def _run(worker, batches, steps):
    losses = []
    for _ in range(steps):
        prepared, _ = worker.compute_old_logp(batches)
        losses.append(worker.train_step(prepared)["train/loss"])
    return losses


def test_checkpoint_resume_is_exact(tmp_path, device):
    config = tiny_recipe(
        "algo.routing_replay=r2", "trainer.lr_warmup_steps=2", "trainer.lr_decay_style=cosine"
    )
    batches = _batches(config, seed=1)
    straight = TrainerWorker(config)
    expected = _run(straight, batches, 3)
    first = TrainerWorker(config)
    _run(first, batches, 1)
    first.save_checkpoint(tmp_path / "ckpt")
    # the save finished in this process, and started no helper process for Megatron's write results
    assert not [p.name for p in multiprocessing.active_children() if "Manager" in p.name]
    resumed = TrainerWorker(tiny_recipe("algo.routing_replay=r2", "trainer.lr_warmup_steps=2",
                                        "trainer.lr_decay_style=cosine", "run.seed=99"))  # fmt: skip
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1
    if device.type == "cpu":
        assert _run(resumed, batches, 2) == expected[1:]
    else:  # float atomics in the MoE token scatter: equal up to rounding on CUDA
        assert _run(resumed, batches, 2) == pytest.approx(expected[1:], rel=1e-4, abs=1e-6)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert_same(b, a, device, tol=1e-4)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_vcpo_scales_the_learning_rate():
    """VCPO: the step's learning rate is ``sqrt(min(1, ESS))``, ESS the normalized effective sample
    size of the token ratios ``exp(old_logp − rollout_logp)`` of the mini-batch, and the optimizer
    steps with it: Adam's first step moves every weight by ``lr·(sign(g) + wd·p)``, so a run with
    the scale moves each weight by the scale times what a run without it moves it."""
    deltas, scales = [], []
    for vcpo in ("true", "false"):
        worker = TrainerWorker(tiny_recipe(f"trainer.vcpo_lr_scaling={vcpo}", "algo.routing_replay='off'"))
        before = [p.detach().clone() for p in worker.model.parameters()]
        mbs, _ = worker.compute_old_logp(_batches(worker.config, seed=2))
        scales.append(worker.train_step(mbs)["train/lr_scale"])
        deltas.append([p.detach() - b for p, b in zip(worker.model.parameters(), before)])
    w = torch.cat([(mb.old_logp - mb.micro.rollout_logp).double().clamp(-20, 20).exp() for mb in mbs])
    ess = float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
    assert 0 < ess < 1  # random rollout log-probs: far off-policy
    assert scales == [pytest.approx(math.sqrt(ess), rel=1e-6), 1.0]
    for on, off in zip(*deltas):
        torch.testing.assert_close(on, scales[0] * off, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.compute_entropy=false"], "compute_entropy"),
        (
            [
                "parallel.pipeline_model_parallel_size=2",
                "parallel.trainer_world_size=2",
                "parallel.virtual_pipeline_model_parallel_size=2",
            ],
            "virtual_pipeline_model_parallel_size",
        ),
        (["trainer.moe_router_fusion=true"], "moe_router_fusion"),
    ],
)
def test_recipe_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        TrainerWorker(tiny_recipe(*overrides))


def test_r3_without_routing_names_the_samples(stack_worker):
    mbs = _batches(stack_worker.config, seed=3, routing=False)
    with pytest.raises(ValueError, match=r"routing_replay=r3 but samples \["):
        stack_worker.compute_old_logp(mbs)


class _Clock:
    """A clock that reads 1, 2, 4, 8, ... s (every span between two readings is a distinct length),
    recording its readings."""

    def __init__(self):
        self.readings: list[float] = []

    def perf_counter(self) -> float:
        self.readings.append(float(2 ** len(self.readings)))
        return self.readings[-1]


@pytest.mark.parametrize("kl", [0.0, 0.5])
def test_a_step_reports_its_model_flop_rate(kl, monkeypatch):
    """The π_old pass counts the model FLOPs of the rank's sequences (prompt + response, as the
    trajectories give them) with `moe_rl.planner.flops`, and with a KL penalty π_ref's forward; the
    update reports the rate over both calls' FLOPs and seconds (timed by an exact clock), and the
    MFU against the matrix product the rank measured on its device."""
    from moe_rl.data.synthetic import random_batch
    from moe_rl.planner.flops import model_flops
    from moe_rl.trainer import worker as worker_module
    from moe_rl.trainer.batch import TrainerBatch

    config = tiny_recipe("algo.routing_replay=off", "trainer.num_mini_batches=2", f"algo.kl.coef={kl}")
    worker = TrainerWorker(config)
    clock = _Clock()  # the worker's timings, exact
    monkeypatch.setattr(worker_module, "time", clock)
    m, t = config.model, config.trainer
    batch = random_batch(
        4, 12, max_prompt_len=6, max_response_len=6, vocab_size=m.vocab_size, sampling_mask=True
    )
    advantages = torch.randn(12, generator=torch.Generator().manual_seed(0))
    prepared = worker.old_logp(TrainerBatch.whole(batch, advantages, t.max_tokens_per_microbatch, 2))
    forward = model_flops(m).forward(batch.sequence_lengths().tolist()) / 1e12  # one pass, TFLOP
    old_s = clock.readings[-1] - clock.readings[0]
    forwards = 2 if kl else 1  # π_old, and π_ref with a KL penalty
    assert prepared.metrics["perf/old_logp_tflop"] == pytest.approx(forwards * forward, rel=1e-12, abs=0)
    assert prepared.metrics["perf/old_logp_s"] == old_s
    first = len(clock.readings)
    out = worker.train(prepared)
    train_s = clock.readings[-1] - clock.readings[first]
    # then every sequence's training forward and backward: 3 forwards
    assert out["perf/tflops"] == pytest.approx((forwards + 3) * forward / (old_s + train_s), rel=1e-12, abs=0)
    assert out["perf/peak_tflops"] > 0
    assert out["perf/mfu"] == pytest.approx(out["perf/tflops"] / out["perf/peak_tflops"], rel=1e-12, abs=0)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradients_and_optimizer_state(worker) -> list[torch.Tensor]:
    """Every parameter's ``main_grad`` (a view of one of Megatron's DDP gradient buffers) and every
    tensor of the optimizer's state (the torch optimizer inside each part)."""
    parts = getattr(worker.optimizer, "chained_optimizers", None) or [worker.optimizer]
    state = [
        value
        for part in parts
        for per_param in part.optimizer.state.values()
        for value in per_param.values()
        if torch.is_tensor(value)
    ]
    return [p.main_grad for p in worker.model.parameters()] + state


def test_released_memory_holds_no_gradient_or_optimizer_state(stack_worker):
    """Before a colocated generation every gradient buffer and the optimizer's moments leave memory
    (the parameters stay without ``params``) and come back as they were."""
    worker = stack_worker
    mbs, _ = worker.compute_old_logp(_batches(worker.config, seed=4))
    worker.train_step(mbs)  # gradients and Adam moments to release
    held = _gradients_and_optimizer_state(worker)
    assert len(held) > sum(1 for _ in worker.model.parameters())  # the optimizer has state
    before, out_bytes = [t.clone() for t in held], _storage_bytes(held)
    released = worker.release_memory()
    try:
        assert [i for i, t in enumerate(held) if t.untyped_storage().nbytes()] == []
        assert all(p.untyped_storage().nbytes() for p in worker.model.parameters())
        assert released["released_bytes"] >= out_bytes
        assert released["weights_bytes"] == _storage_bytes(list(worker.model.parameters()))
        if worker.device.type == "cpu":  # on CUDA the process's allocations, other tests' too
            assert released["resident_bytes"] == released["weights_bytes"]  # nothing else stays
    finally:
        worker.restore_memory()
    for i, (t, b) in enumerate(zip(held, before, strict=True)):
        assert torch.equal(t, b), i


def test_the_driver_counts_what_a_release_gives_back(device):
    """On CUDA the driver's count of this process's memory (NVML) grows by what it allocates and
    falls back when an `Offload` releases it (the caching allocator's segments go back); on a CPU
    there are no driver readings."""
    from moe_rl.offload import GIB, DriverMemory, Offload, release_device_cache

    driver = DriverMemory(device)
    if device.type == "cpu":
        assert driver.readings("engine", "asleep") == {} and math.isnan(driver.process_bytes())
        return
    before = driver.process_bytes()
    held = torch.ones(1 << 30, dtype=torch.uint8, device=device)
    grown = driver.process_bytes()
    offload = Offload("test")
    offload.add([held])
    offload.release(keep=False)
    after = driver.readings("engine", "asleep")
    assert grown - before >= 1 << 30
    assert after["memory/engine_asleep_device_gib"] * GIB - before < 64 << 20
    assert after["memory/engine_context_gib"] * GIB <= before
    assert after["memory/engine_asleep_gpu_used_gib"] >= after["memory/engine_asleep_device_gib"]
    x = torch.ones(256, 256, device=device)
    _ = x @ x  # cuBLAS takes its workspace from the caching allocator
    with_workspace = torch.cuda.memory_allocated(device)
    release_device_cache()  # as every release does
    assert torch.cuda.memory_allocated(device) < with_workspace


def test_parameters_released_for_a_generation_come_back_for_a_weight_sync(stack_worker):
    """`cluster.offload_params`: an engine restarted during a colocated generation is brought to the
    weights while the parameters are out; the sync takes them back for its span (the engine gets the
    trainer's weights, not emptied storages) and they leave again until the generation ends."""
    from moe_rl.config.sync_plan import sync_plan
    from moe_rl.rollout.megatron_engine import MegatronEngine
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import Receiver

    worker = stack_worker
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    out_bytes = _storage_bytes([*worker.model.parameters(), *_gradients_and_optimizer_state(worker)])
    engine = MegatronEngine(tiny_recipe("rollout.quant=bf16"))  # the worker's model, bf16 on the wire
    plan = sync_plan(engine.config, "cpu", in_process=True)
    sender = RankSender(worker.model, engine.config.quant, worker.config.model.num_layers, plan)
    released = worker.release_memory(params=True)
    try:
        assert all(p.untyped_storage().nbytes() == 0 for p in worker.model.parameters())
        engine.begin_weight_update(7)
        with worker.weights_resident():
            sender.send({0: Receiver(engine.receive_bucket)}, timeout_s=10.0)
        engine.finish_weight_update(7)
        assert [
            n for n, p in worker.model.named_parameters() if p.untyped_storage().nbytes()
        ] == []  # out again
    finally:
        worker.restore_memory()
    reference = MegatronEngine(engine.config)
    reference.update_weights(iter_hf_weights(worker.model), version=7)
    for (name, a), b in zip(engine.model.named_parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for name, p in worker.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert released["released_bytes"] >= out_bytes  # parameters, gradients and optimizer state
