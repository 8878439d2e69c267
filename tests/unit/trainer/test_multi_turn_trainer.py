"""Multi-turn trajectories in the trainer: the loss and every correction see only the tokens the
model sampled, while R3 replays the engine's routing on every position, environment tokens
included (they were prefilled, so they were routed)."""

from __future__ import annotations

import itertools
import math

import torch
from trainer_testing import tiny_recipe

from moe_rl.algo.advantages import grpo
from moe_rl.data.packing import pack_samples
from moe_rl.data.synthetic import random_batch
from moe_rl.data.validate import validate
from moe_rl.trainer.batch import TrainerBatch
from moe_rl.trainer.worker import TrainerWorker


def _batch(config, seed: int = 5):
    m = config.model
    batch = random_batch(
        seed, 8, max_prompt_len=5, max_response_len=8, vocab_size=m.vocab_size,
        routing=(m.num_layers - m.first_k_dense_layers, m.moe_router_topk, m.num_experts),
        sampling_mask=True, env_tokens=True, group_size=4,
    )  # fmt: skip
    validate(batch, vocab_size=m.vocab_size, num_experts=m.num_experts, topk=m.moe_router_topk)
    assert not bool(batch.sampled.all())
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 1.0, 0.0, 0.7])
    return batch.replace(rewards=rewards, group_ids=torch.arange(2).repeat_interleave(4))


def _scramble_environment_fields(batch):
    """Other rollout log-probs, kept sets and versions on the environment tokens only."""
    env = ~batch.sampled
    logp = batch.rollout_logp.clone()
    logp[env] = -torch.rand(int(env.sum()), generator=torch.Generator().manual_seed(1)) * 5
    offsets = batch.sampling_mask_offsets
    rows = [batch.sampling_mask_ids[int(a) : int(b)] for a, b in itertools.pairwise(offsets)]
    for t in env.nonzero().flatten().tolist():
        rows[t] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.cat(rows)
    new_offsets = torch.zeros_like(offsets)
    new_offsets[1:] = torch.cumsum(torch.tensor([r.numel() for r in rows]), 0)
    return batch.replace(rollout_logp=logp, sampling_mask_ids=ids, sampling_mask_offsets=new_offsets)


def _prepared(worker: TrainerWorker, batch, advantages):
    t = worker.config.trainer
    return worker.old_logp(
        TrainerBatch.whole(batch, advantages, t.max_tokens_per_microbatch, t.num_mini_batches)
    )


def _loss_and_grads(worker: TrainerWorker, batch) -> tuple[float, list[torch.Tensor], dict]:
    advantages = grpo(batch.rewards, batch.group_ids)
    prepared = _prepared(worker, batch, advantages)
    loss_sum, denom, _ = worker.accumulate_gradients(prepared.mini_batches[0])
    grads = [p.main_grad.detach().clone() for p in worker.model.parameters() if p.requires_grad]
    return float(loss_sum / denom), grads, prepared.metrics


def test_environment_tokens_are_context_not_response_tokens():
    config = tiny_recipe()
    batch = _batch(config)
    micro = pack_samples(batch, torch.arange(batch.num_samples))
    assert micro.response_positions.numel() == int(batch.sampled.sum())
    assert int(micro.loss_mask.sum()) == int(batch.sampled.sum())
    assert bool(torch.isfinite(micro.rollout_logp).all())  # no NaN of an environment token gets in
    # every position is routed: the trace covers environment tokens too
    assert micro.routed_experts.shape[0] == micro.num_tokens
    env_positions = torch.tensor(
        [p for p in range(micro.num_tokens) if not micro.loss_mask[p]], dtype=torch.int64
    )
    assert env_positions.numel() > int(batch.prompt_lengths().sum())  # prompts + environment tokens


def test_environment_rollout_fields_cannot_change_the_loss_and_r3_replays_their_routing():
    config = tiny_recipe("trainer.num_mini_batches=1")  # the stack: R3, KSM, IcePop, OPSM, ESPO
    assert config.algo.routing_replay == "r3" and config.algo.corrections.keep_sampling_mask
    worker = TrainerWorker(config)
    batch = _batch(config)
    loss, grads, old = _loss_and_grads(worker, batch)
    assert math.isfinite(loss) and any(bool(g.abs().sum() > 0) for g in grads)
    assert math.isfinite(old["old/kl_k3"])

    same_loss, same_grads, _ = _loss_and_grads(worker, _scramble_environment_fields(batch))
    assert same_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, same_grads, strict=True))

    # what the environment wrote is context: another environment token changes the loss
    env_token = int((~batch.sampled).nonzero()[0, 0])
    ids = batch.response_ids.clone()
    ids[env_token] = (ids[env_token] + 1) % config.model.vocab_size
    other_loss, _, _ = _loss_and_grads(worker, batch.replace(response_ids=ids))
    assert other_loss != loss

    # R3 replays the trace on environment tokens: other experts there change what follows them
    trace = batch.routed_experts.clone()
    sample = next(i for i in range(batch.num_samples) if not bool(batch.sample(i).sampled.all()))
    within = int((~batch.sample(sample).sampled).nonzero()[0, 0])
    row = int(batch.routing_offsets[sample]) + int(batch.prompt_lengths()[sample]) + within
    num_experts = config.model.num_experts
    trace[row] = (trace[row].to(torch.int64) + 1).remainder(num_experts).to(trace.dtype)
    advantages = grpo(batch.rewards, batch.group_ids)
    prepared = _prepared(worker, batch, advantages)
    before = {int(i): mb for mini in prepared.mini_batches for mb in mini for i in mb.micro.sample_indices}
    base = before[sample].old_logp.clone()
    prepared = _prepared(worker, batch.replace(routed_experts=trace), advantages)
    after = {int(i): mb for mini in prepared.mini_batches for mb in mini for i in mb.micro.sample_indices}
    assert not torch.equal(after[sample].old_logp, base)
