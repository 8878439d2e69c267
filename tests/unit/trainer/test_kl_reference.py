"""The KL penalty against a frozen reference policy (``algo.kl.coef > 0``): the reference is the
starting weights, frozen and outside the optimizer; its log-probs come from the old-logp pass under
the policy's routing (R3 the engine's, R2 the recorded one) and kept sets; the KL term's value and
gradient equal a hand computation; a resumed run keeps the original reference; the penalty pulls a
displaced policy back to the reference on every device; the in-process RL loop trains with it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from trainer_testing import (
    TINY_MODEL_OVERRIDES,
    TINY_RECIPE,
    assert_same,
    micro_batches,
    run_old_pass,
    tiny_recipe,
)

from moe_rl.config import ConfigError
from moe_rl.config.modes import ReplayMode
from moe_rl.megatron.forward import forward_logits
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.orchestration.preflight import check, load_checked
from moe_rl.trainer.logprobs import response_logprobs
from moe_rl.trainer.worker import TrainerWorker

pytestmark = pytest.mark.usefixtures("device")

COEF = 0.7


def _batches(config, seed: int = 0):
    return micro_batches(seed, 12, config.model, max_tokens=48)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _perturb(model: torch.nn.Module, scale: float, seed: int = 5) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, device="cpu").to(p.device))


def test_reference_is_the_frozen_starting_policy(device):
    config = tiny_recipe(f"algo.kl.coef={COEF}")  # the stability stack: R3, keep-sampling-mask, ESPO
    worker = TrainerWorker(config)
    ref = worker.reference.model
    assert type(ref) is type(worker.model) and ref is not worker.model and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    in_optimizer = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert in_optimizer and not in_optimizer & {id(p) for p in ref.parameters()}
    start = _tensors(worker.model)
    assert _tensors(ref).keys() == start.keys()
    for name, value in _tensors(ref).items():
        assert torch.equal(value, start[name]), name

    batches = _batches(config)
    mbs, _ = worker.compute_old_logp(batches)
    for mb in mbs:  # same weights, same replayed routing, same kept sets
        assert_same(mb.ref_logp, mb.old_logp, device)
    ref_logp = [mb.ref_logp.clone() for mb in mbs]
    first = worker.train_step(mbs)
    assert first["train/kl/ref_k3"] == pytest.approx(0.0, abs=1e-6)
    mbs, _ = worker.compute_old_logp(batches)
    assert any(not torch.equal(mb.old_logp, before) for mb, before in zip(mbs, ref_logp))  # π_old moved
    for mb, before in zip(mbs, ref_logp):  # π_ref did not
        assert_same(mb.ref_logp, before, device)
    second = worker.train_step(mbs)
    assert second["train/kl/ref_k3"] > 1e-6
    for name, value in _tensors(ref).items():
        assert torch.equal(value, start[name]), name


def test_r2_reference_replays_the_policys_recorded_routing(device):
    config = tiny_recipe(f"algo.kl.coef={COEF}", "algo.routing_replay=r2")
    worker = TrainerWorker(config)
    reference = worker.reference
    with torch.no_grad():  # a reference whose routers would choose other experts on their own
        for _, router in reference.replay.routers:
            router.weight.mul_(-3.0)
    mbs, _ = worker.compute_old_logp(_batches(config, seed=4))
    options = worker.passes.options
    natural_differs = False
    for mb in mbs:
        assert mb.recorded_routing is not None
        # the recorded routing replayed on the reference (one stage: its layers are all of them)
        recorded = mb.recorded_routing.to(mb.micro.routed_experts.dtype)
        traced = dataclasses.replace(mb, micro=dataclasses.replace(mb.micro, routed_experts=recorded))
        [replayed], _ = run_old_pass(reference.model, [traced], options, ReplayMode.R3, reference.replay)
        [natural], _ = run_old_pass(reference.model, [mb], options)
        replayed, natural = replayed.old_logp, natural.old_logp
        assert_same(mb.ref_logp, replayed, device)
        natural_differs |= not torch.allclose(natural, replayed, atol=1e-4)
    assert natural_differs


def _by_hand(estimator: str, logp, ref_logp, old_logp):
    """Schulman's estimators with log r = ref_logp − logp; DeepSeek-V3.2 Eq. 7 for k3_is."""
    log_r = ref_logp - logp
    k3 = torch.exp(log_r) - log_r - 1
    return {
        "k1": -log_r,
        "k2": 0.5 * log_r**2,
        "k3": k3,
        "abs": log_r.abs(),
        "k3_is": torch.exp(logp - old_logp) * k3,
    }[estimator]


@pytest.mark.parametrize(
    ("estimator", "mode"),
    [("k1", "decoupled"), ("k2", "decoupled"), ("k3", "decoupled"), ("abs", "decoupled"),
     ("k3_is", "decoupled"), ("k3_is", "bypass")],
)  # fmt: skip
def test_kl_term_value_and_gradient_by_hand(estimator, mode, device):
    """With zero advantages the policy term has no gradient, so the worker's gradient is the KL
    term's: ``coef · Σ_i mean_t kl_t / #responses`` (seq-mean-token-mean), here by hand."""
    config = tiny_recipe(
        f"algo.kl.coef={COEF}", f"algo.kl.estimator={estimator}", f"algo.policy_mode={mode}",
        "algo.objective=reinforce", "algo.aggregation=seq_mean_token_mean",
        "algo.corrections.icepop.enabled=false", "algo.corrections.opsm.enabled=false",
    )  # fmt: skip
    worker = TrainerWorker(config)
    _perturb(worker.reference.model, 0.05)
    mbs = _batches(config, seed=2)
    for mb in mbs:
        mb.advantages = torch.zeros_like(mb.advantages)
    mbs, _ = worker.compute_old_logp(mbs)
    loss_sum, denom, metrics = worker.accumulate_gradients(mbs)

    policy = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)
    replay = RoutingReplay(policy)
    total, responses = 0.0, 0
    for mb, found in zip(mbs, metrics):
        with replay.replay(mb.micro.routed_experts, mb.micro.num_tokens, mb.sample_of_token):
            logits = forward_logits(policy, mb.micro)
        logp = response_logprobs(logits, mb.micro, config.rollout.temperature, 1024, keep_sampling_mask=True)
        sampling = mb.micro.rollout_logp if mode == "bypass" else mb.old_logp
        kl = _by_hand(estimator, logp, mb.ref_logp, sampling)
        assert not torch.allclose(mb.ref_logp, logp.detach(), atol=1e-4)  # the reference differs
        assert float(found[f"kl/ref_{estimator}"]) == pytest.approx(
            float(kl.detach().mean()), rel=1e-5, abs=1e-7
        )
        for i in range(mb.num_samples):
            tokens = kl[mb.seq_ids == i]
            if tokens.numel():  # a response with no tokens counts in neither sum nor denominator
                total, responses = total + tokens.mean(), responses + 1
    loss = COEF * total / responses
    loss.backward()
    assert float(denom) == responses
    assert float(loss_sum / denom) == pytest.approx(float(loss), rel=1e-5)
    grads = dict(worker.model.named_parameters())
    assert sum(float(p.grad.abs().sum()) for p in policy.parameters() if p.grad is not None) > 0
    for name, p in policy.named_parameters():
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(grads[name].main_grad, want, rtol=1e-4, atol=1e-7, msg=name)


def test_resume_keeps_the_original_reference(tmp_path, device):
    config = tiny_recipe(f"algo.kl.coef={COEF}")
    first = TrainerWorker(config)
    start = _tensors(first.model)
    mbs, _ = first.compute_old_logp(_batches(config, seed=1))
    first.train_step(mbs)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = TrainerWorker(tiny_recipe(f"algo.kl.coef={COEF}", "run.seed=99"))  # another start
    assert any(not torch.equal(v, start[k]) for k, v in _tensors(resumed.reference.model).items())
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1
    for name, value in _tensors(resumed.reference.model).items():
        assert torch.equal(value, start[name]), name
    policy = _tensors(first.model)
    for name, value in _tensors(resumed.model).items():
        assert torch.equal(value, policy[name]), name
    a, _ = first.compute_old_logp(_batches(config, seed=3))
    b, _ = resumed.compute_old_logp(_batches(config, seed=3))
    for x, y in zip(a, b):
        assert_same(y.ref_logp, x.ref_logp, device)
        assert not torch.equal(x.ref_logp, x.old_logp)


def test_checkpoints_with_and_without_a_reference(tmp_path, caplog, device):
    plain = TrainerWorker(tiny_recipe())
    mbs, _ = plain.compute_old_logp(_batches(plain.config, seed=6))
    plain.train_step(mbs)
    plain.save_checkpoint(tmp_path / "plain")
    kl = TrainerWorker(tiny_recipe(f"algo.kl.coef={COEF}", "run.seed=7"))
    built = _tensors(kl.reference.model)
    with caplog.at_level(logging.WARNING):
        assert kl.load_checkpoint(tmp_path / "plain") == 1
    assert "holds no reference policy" in caplog.text
    for name, value in _tensors(kl.reference.model).items():  # the reference this run started from
        assert torch.equal(value, built[name]), name
    kl.save_checkpoint(tmp_path / "kl")
    assert TrainerWorker(tiny_recipe()).load_checkpoint(tmp_path / "kl") == 1  # its reference is not read


def test_offloaded_reference_lives_in_host_memory_between_passes(device):
    worker = TrainerWorker(tiny_recipe(f"algo.kl.coef={COEF}", "algo.kl.offload_reference=true"))
    on_gpu = device.type == "cuda"
    assert worker.reference.offloaded == on_gpu  # on the CPU there is nothing to offload
    home = "cpu" if on_gpu else device.type
    assert all(p.device.type == home for p in worker.reference.model.parameters())
    mbs, _ = worker.compute_old_logp(_batches(worker.config, seed=5))
    assert all(p.device.type == home for p in worker.reference.model.parameters())
    for mb in mbs:
        assert mb.ref_logp.device == device
        assert_same(mb.ref_logp, mb.old_logp, device)


def test_kl_coefficient_is_checked():
    with pytest.raises(ConfigError, match=r"algo.kl.coef=-0.1 must be >= 0"):
        tiny_recipe("algo.kl.coef=-0.1")
    check(tiny_recipe("algo.kl.coef=0.1", "algo.kl.estimator=k3_is"))  # every component accepts it


def test_the_penalty_pulls_a_displaced_policy_back_to_the_reference(device):
    """The penalty alone (zero advantages) pulls a policy moved away from the reference back
    towards it on the tokens it trains on, step after step, with the optimizer this device trains
    with (Megatron's on CUDA, AdamW over Megatron's gradients on the CPU); without the penalty the
    same steps leave it where it was. (Measured on other tokens, or as a distance between weights,
    the pull is no test: the k3 term fits the log-probs of the tokens it sees, and Adam moves every
    weight whose gradient is not zero by about the learning rate.)"""
    curves = {}
    for coef in (0.0, 1.0):
        config = tiny_recipe(f"algo.kl.coef={max(coef, 1e-12)}", "algo.kl.estimator=k3", "trainer.lr=1e-3")
        worker = TrainerWorker(config)
        if coef == 0.0:
            worker.loss = dataclasses.replace(
                worker.loss, kl=None
            )  # a reference to measure against, no penalty
        _perturb(worker.model, 0.05)
        mbs = _batches(config, seed=8)
        for mb in mbs:
            mb.advantages.zero_()
        curve = []
        for _ in range(5):
            prepared, _ = worker.compute_old_logp(mbs)
            log_ratio = torch.cat([mb.ref_logp - mb.old_logp for mb in prepared])  # log π_ref / π
            curve.append(float((log_ratio.exp() - log_ratio - 1).mean()))
            worker.train_step(prepared)
        curves[coef] = curve
    free, pulled = curves[0.0], curves[1.0]
    assert pulled[0] > 1e-2 and free[0] == pytest.approx(pulled[0], rel=1e-4), curves  # the same start
    assert free[-1] == pytest.approx(free[0], rel=1e-3), curves
    assert pulled[1] < 0.6 * pulled[0] and pulled[-1] < 0.25 * pulled[0], (
        curves
    )  # CPU: 0.031 → 0.0099 → 0.0034


def test_the_in_process_loop_trains_with_the_penalty():
    from moe_rl.orchestration.local import LocalRun

    # one mini-batch per step: step 0's KL is measured before any update. With two, the second is
    # measured after the first's optimizer step, and Adam turns even a round-off gradient (CUDA's
    # training and no-grad passes differ in the last bits) into a step of about the learning rate.
    config = load_checked(TINY_RECIPE, [
        *TINY_MODEL_OVERRIDES, "rollout.batch_size=16", "rollout.quant=bf16", "algo.kl.coef=1.0",
        "algo.kl.estimator=k3", "trainer.num_mini_batches=1",
    ])  # fmt: skip
    records = list(LocalRun(config).run(2))
    assert all("train/kl/ref_k3" in r for r in records)
    assert records[0]["train/kl/ref_k3"] == pytest.approx(0.0, abs=1e-6) and records[1]["train/kl/ref_k3"] > 0
