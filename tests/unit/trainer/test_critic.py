"""PPO with a critic and REINFORCE++ in the trainer: the values, returns and whitened advantages
of the π_old pass, the critic's own step and warm-up, its start and its checkpoint (the TrainerWorker
that runs them, on the tiny recipe's model)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from trainer_testing import micro_batches, one_response, tiny_recipe

from moe_rl.algo.kl import kl_penalty
from moe_rl.algo.modes import KLEstimator
from moe_rl.megatron.forward import packed_seq_params, pad_micro_batch
from moe_rl.megatron.lora import is_adapter
from moe_rl.trainer.critic import HEAD, ValueHead, body_state
from moe_rl.trainer.worker import TrainerWorker

PPO = ("algo.advantage=gae", "rollout.group_size=1", "critic.lr=1e-3")


def _batches(config, seed: int = 0):
    return micro_batches(seed, 12, config.model, max_tokens=48)


def _whitened(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return ((x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)).float()


def _scores(mbs) -> list[torch.Tensor]:
    return [torch.zeros(mb.num_samples).scatter(0, mb.seq_ids, mb.advantages) for mb in mbs]


@pytest.fixture(scope="module")
def ppo_worker():
    return TrainerWorker(tiny_recipe(*PPO, "critic.warmup_steps=1"))


def test_gae_at_the_first_pass_is_the_whitened_outcome(ppo_worker):
    """The head starts at zero, so V = 0 and, with γ = λ = 1 and no KL in the reward, every token's
    return is its response's score and its advantage that score whitened over the batch's tokens."""
    worker = ppo_worker
    assert isinstance(worker.critic.model.output_layer, ValueHead)
    mbs = _batches(worker.config)
    prepared, metrics = worker.compute_old_logp(mbs)
    scores = torch.cat([mb.advantages for mb in mbs])  # the driver's scores, broadcast
    assert torch.equal(torch.cat([mb.old_values for mb in prepared]), torch.zeros_like(scores))
    assert torch.equal(torch.cat([mb.returns for mb in prepared]), scores)
    torch.testing.assert_close(torch.cat([mb.advantages for mb in prepared]), _whitened(scores))
    assert metrics["advantage/token_mean_raw"] == pytest.approx(float(scores.double().mean()), rel=1e-9)
    assert metrics["advantage/token_std_raw"] == pytest.approx(float(scores.double().std()), rel=1e-9)
    assert metrics["returns/values_mean"] == 0.0


def test_gae_by_hand_with_values_and_discount():
    """γ = 0.9, λ = 0.5 with a critic whose head is not zero: each token's advantage is the GAE sum
    of its response's TD errors with the critic's values, whitened; the returns are A + V."""
    worker = TrainerWorker(tiny_recipe(*PPO, "algo.gae.gamma=0.9", "algo.gae.lam=0.5", "critic.init=config"))
    with torch.no_grad():
        worker.critic.model.output_layer.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    mbs = _batches(worker.config, seed=5)
    prepared, _ = worker.compute_old_logp(mbs)
    for mb in prepared:  # the value of a token's state: the critic's output one position before it
        tokens, positions, cu = pad_micro_batch(mb.micro, None)
        with torch.no_grad():
            out = worker.critic.model(
                tokens[None], positions[None], attention_mask=None, packed_seq_params=packed_seq_params(cu)
            )
        assert torch.equal(mb.old_values, out.reshape(-1)[mb.micro.response_positions - 1].float())
    raw, values_all = [], []
    for mb, scores in zip(prepared, _scores(mbs)):
        values = mb.old_values.double()
        assert values.abs().sum() > 0
        for i in range(mb.num_samples):
            v = values[mb.seq_ids == i].tolist()
            rewards = [0.0] * (len(v) - 1) + [float(scores[i])]
            adv, running = [0.0] * len(v), 0.0
            for t in reversed(range(len(v))):
                nxt = v[t + 1] if t + 1 < len(v) else 0.0
                running = rewards[t] + 0.9 * nxt - v[t] + 0.9 * 0.5 * running
                adv[t] = running
            raw += adv
            values_all += v
    raw_t, values_t = torch.tensor(raw, dtype=torch.float64), torch.tensor(values_all, dtype=torch.float64)
    torch.testing.assert_close(
        torch.cat([mb.returns for mb in prepared]).double(), raw_t + values_t, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        torch.cat([mb.advantages for mb in prepared]), _whitened(raw_t), atol=1e-5, rtol=1e-5
    )


def test_the_batch_statistics_of_one_response_of_one_and_two_tokens():
    """At the smallest batches, with a critic whose head is not zero: the raw advantages' mean and
    unbiased standard deviation (0 for one token), the returns', values' and token rewards' means,
    each over the batch's tokens; all 0 for a batch of no token."""
    worker = TrainerWorker(tiny_recipe(*PPO, "critic.init=config"))
    with torch.no_grad():
        worker.critic.model.output_layer.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    (empty,) = one_response(worker.config.model, 0)  # a batch whose responses have no token
    _, metrics = worker.compute_old_logp([empty])
    assert {k: v for k, v in metrics.items() if k.startswith(("advantage/", "returns/"))} == {
        "advantage/token_mean_raw": 0.0, "advantage/token_std_raw": 0.0, "returns/mean": 0.0,
        "returns/token_reward_mean": 0.0, "returns/values_mean": 0.0,
    }  # fmt: skip
    for tokens in (1, 2):
        mbs = one_response(worker.config.model, tokens)
        prepared, metrics = worker.compute_old_logp(mbs)
        returns = torch.cat([mb.returns for mb in prepared]).double()
        values = torch.cat([mb.old_values for mb in prepared]).double()
        raw = returns - values  # the returns are A + V
        assert returns.numel() == tokens and values.abs().min() > 0
        assert metrics["advantage/token_mean_raw"] == pytest.approx(float(raw.mean()), rel=1e-5)
        std = float(raw.std()) if tokens > 1 else 0.0
        assert metrics["advantage/token_std_raw"] == pytest.approx(std, rel=1e-4, abs=1e-12), tokens
        assert metrics["returns/mean"] == pytest.approx(float(returns.mean()), rel=1e-5)
        assert metrics["returns/values_mean"] == pytest.approx(float(values.mean()), rel=1e-5)
        score = float(mbs[0].advantages[0])  # the reward is the response's score, on its last token
        assert metrics["returns/token_reward_mean"] == pytest.approx(score / tokens, rel=1e-5)


def test_the_critic_is_a_model_of_its_own_with_settings_of_its_own():
    """A tied policy's critic is untied (its head is not the embedding); its own initialization
    (critic.init=config) is the policy's model built from run.seed + 1; it learns at critic.lr from
    its first step whatever the trainer's warm-up; its gradient buffers hold every parameter's
    gradient (dense and expert)."""
    from moe_rl.megatron.model import build_gpt_model

    config = tiny_recipe(
        *PPO, "model.tie_word_embeddings=true", "critic.init=config", "trainer.lr_warmup_steps=3"
    )
    worker = TrainerWorker(config)
    critic = worker.critic
    assert worker.model.share_embeddings_and_output_weights
    assert not critic.model.share_embeddings_and_output_weights
    untied = dataclasses.replace(config.model, tie_word_embeddings=False)
    body = body_state(critic.model)
    for seed, same in ((config.run.seed + 1, True), (config.run.seed, False)):
        built = build_gpt_model(untied, config.parallel, config.trainer, seed=seed).state_dict()
        assert all(torch.equal(v, built[k]) for k, v in body.items() if isinstance(v, torch.Tensor)) == same
    assert {group["lr"] for group in critic.optimizer.param_groups} == {config.critic.lr}
    assert all(group["lr"] < config.trainer.lr for group in worker.optimizer.param_groups)  # warming up
    held = sum(buffer.numel() for buffer in critic.grad_buffers())
    assert held >= sum(p.numel() for p in critic.model.parameters())


def test_a_critic_body_holds_neither_the_head_nor_adapters():
    worker = TrainerWorker(tiny_recipe("lora.rank=4", "lora.alpha=8"))
    state = worker.model.state_dict()
    assert any(is_adapter(k) for k in state) and any(k.startswith(HEAD) for k in state)
    body = body_state(worker.model)
    assert body and not [k for k in body if is_adapter(k) or k.startswith(HEAD)]


def _policy_params(worker):
    return [p.detach().clone() for p in worker.model.parameters()]


def test_warm_up_trains_the_critic_alone_then_both(ppo_worker):
    """In the warm-up step the policy's weights stay and the critic's head moves; after it both move,
    and the critic's loss on the same batch falls."""
    worker = ppo_worker
    mbs = _batches(worker.config, seed=1)
    head = worker.critic.model.output_layer.weight
    before, head_before = _policy_params(worker), head.detach().clone()
    prepared, _ = worker.compute_old_logp(mbs)
    first = worker.train_step(prepared)
    assert first["train/policy_frozen"] == 1.0 and "train/loss" not in first
    assert all(torch.equal(a, b) for a, b in zip(before, _policy_params(worker)))
    assert not torch.equal(head, head_before) and first["critic/update_ok"] == 1.0
    assert first["critic/loss"] > 0 and math.isfinite(first["critic/grad_norm"])
    # from V = V_old = 0 the loss is ½·mean(R²) over the tokens, and Adam's first step moves each
    # weight of the head by the learning rate (g / (|g| + ε), no weight decay)
    returns = torch.cat([mb.returns for mb in prepared]).double()
    assert first["critic/loss"] == pytest.approx(float(0.5 * (returns**2).mean()), rel=1e-5)
    moved = (head.detach() - head_before).abs().max()
    assert float(moved) == pytest.approx(worker.config.critic.lr, rel=1e-3)
    prepared, _ = worker.compute_old_logp(mbs)
    second = worker.train_step(prepared)
    assert "train/policy_frozen" not in second and second["train/update_ok"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, _policy_params(worker)))
    assert second["critic/loss"] < first["critic/loss"]


def test_the_critic_starts_from_the_policy_or_its_own_init():
    policy_start = TrainerWorker(tiny_recipe(*PPO))
    own = TrainerWorker(tiny_recipe(*PPO, "critic.init=config"))
    body = {k: v for k, v in policy_start.critic.model.state_dict().items() if not k.startswith(HEAD)}
    policy = policy_start.model.state_dict()
    floats = [k for k, v in body.items() if torch.is_tensor(v) and v.is_floating_point()]
    assert floats and all(torch.equal(body[k], policy[k]) for k in floats)
    assert any(not torch.equal(own.critic.model.state_dict()[k], policy[k]) for k in floats)
    assert not own.critic.model.output_layer.weight.any()


def _steps(worker, batches, n):
    out = []
    for _ in range(n):
        prepared, _ = worker.compute_old_logp(batches)
        out.append(worker.train_step(prepared))
    return [(m["train/loss"], m["critic/loss"]) for m in out]


def test_resume_restores_the_critic_exactly(tmp_path, device):
    config = tiny_recipe(*PPO, "algo.routing_replay=off")
    batches = _batches(config, seed=2)
    straight = TrainerWorker(config)
    expected = _steps(straight, batches, 3)
    first = TrainerWorker(config)
    _steps(first, batches, 1)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = TrainerWorker(tiny_recipe(*PPO, "algo.routing_replay=off", "run.seed=7"))
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1 and resumed.critic.step == 1
    if device.type == "cpu":
        assert _steps(resumed, batches, 2) == expected[1:]
    else:
        assert _steps(resumed, batches, 2) == pytest.approx(expected[1:], rel=1e-4)
    for name, a in straight.critic.model.state_dict().items():
        if torch.is_tensor(a) and a.is_floating_point():
            torch.testing.assert_close(resumed.critic.model.state_dict()[name], a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reinforce_pp_returns_carry_the_kl_in_the_reward(estimator):
    """REINFORCE++ with the KL in the reward: r_t = [t last]·s_i − β·kl(π_old, π_ref)_t, the
    advantages are the undiscounted returns whitened, no KL term in the loss and no critic."""
    worker = TrainerWorker(
        tiny_recipe(
            "algo.advantage=reinforce_pp", "algo.kl.coef=0.5", "algo.kl.in_reward=true",
            f"algo.kl.estimator={estimator}",
        )
    )  # fmt: skip
    assert worker.critic is None and worker.loss.kl is None
    with torch.no_grad():  # the reference differs from the policy
        for p in worker.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    mbs = _batches(worker.config, seed=3)
    prepared, metrics = worker.compute_old_logp(mbs)
    expected = []
    for mb, scores in zip(prepared, _scores(mbs)):
        kl = kl_penalty(mb.old_logp.double(), mb.ref_logp.double(), estimator=KLEstimator(estimator))
        assert kl.abs().sum() > 0
        for i in range(mb.num_samples):
            r = -0.5 * kl[mb.seq_ids == i]
            if r.numel() == 0:  # a response of no token
                continue
            r[-1] += scores[i]
            expected.append(r.flip(0).cumsum(0).flip(0))
    returns = torch.cat(expected)
    torch.testing.assert_close(
        torch.cat([mb.returns for mb in prepared]).double(), returns, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        torch.cat([mb.advantages for mb in prepared]), _whitened(returns), atol=1e-5, rtol=1e-5
    )
    assert metrics["returns/mean"] == pytest.approx(float(returns.mean()), rel=1e-5)
    assert "train/kl" not in worker.train_step(prepared)


def test_a_ppo_checkpoint_gives_the_policy_alone(tmp_path):
    """What `moe-rl export` and `model.init_from` read of a checkpoint with a critic: the policy's
    weights (the critic's ``critic.`` keys and its optimizer stay unread), equal to the trainer's;
    and a critic started from that checkpoint (critic.init=checkpoint) takes the policy's body."""
    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.run_dir import write_manifest
    from moe_rl.trainer.checkpoint import load_model_weights

    config = tiny_recipe(*PPO, "algo.routing_replay=off")
    worker = TrainerWorker(config)
    _steps(worker, _batches(config, seed=4), 1)
    folder = worker.save_checkpoint(tmp_path / "ckpt" / "trainer")
    write_manifest(tmp_path / "ckpt")
    policy = build_gpt_model(config.model, config.parallel, config.trainer, seed=99)
    load_model_weights(policy, folder)
    for name, value in worker.model.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(policy.state_dict()[name], value), name
    started = TrainerWorker(
        tiny_recipe(*PPO, "critic.init=checkpoint", f"critic.init_from={tmp_path / 'ckpt'}")
    )
    trained = {k: v for k, v in worker.model.state_dict().items() if not k.startswith(HEAD)}
    body = started.critic.model.state_dict()
    assert all(
        torch.equal(body[k], v) for k, v in trained.items() if torch.is_tensor(v) and v.is_floating_point()
    )
