"""RL-ZVP in the trainer: the driver's zero-variance signs (over the whole batch) become token
advantages from π_old's entropy on each rank, by the paper's formulas; the rules refuse what it
cannot run."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_testing import tiny_recipe

from moe_rl.algo.advantages import grpo, zero_variance_signs
from moe_rl.data.synthetic import random_batch
from moe_rl.trainer.batch import TrainerBatch
from moe_rl.trainer.rules import check_trainer
from moe_rl.trainer.worker import TrainerWorker

ALPHA = 0.3


def _batch(config):
    m = config.model
    trace = (m.num_layers - m.first_k_dense_layers, m.moe_router_topk, m.num_experts)
    batch = random_batch(
        3,
        12,
        max_prompt_len=6,
        max_response_len=6,
        vocab_size=m.vocab_size,
        routing=trace,
        sampling_mask=True,
    )
    # three prompts of four: all correct, all wrong, mixed
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 1.0])
    groups = torch.arange(3).repeat_interleave(4)
    return batch.replace(rewards=rewards, group_ids=groups), rewards, groups


def test_signs_mark_all_correct_and_all_wrong_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert zero_variance_signs(rewards, groups).tolist() == [1, 1, -1, -1, 0, 0, 1]


def test_the_worker_shapes_zero_variance_advantages_from_old_entropy():
    config = tiny_recipe("algo.zero_variance_shaping=true", f"algo.zero_variance_alpha={ALPHA}")
    worker = TrainerWorker(config)
    batch, rewards, groups = _batch(config)
    adv = grpo(rewards, groups)
    signs = zero_variance_signs(rewards, groups)
    t = config.trainer
    with pytest.raises(ValueError, match="zero_variance_shaping=True but zero-variance signs were not given"):
        worker.old_logp(TrainerBatch.whole(batch, adv, t.max_tokens_per_microbatch, t.num_mini_batches))
    prepared = worker.old_logp(
        TrainerBatch.whole(batch, adv, t.max_tokens_per_microbatch, t.num_mini_batches, zvp_signs=signs)
    )
    metrics = prepared.metrics
    assert metrics["old/zvp_token_share"] == pytest.approx(2 / 3, abs=0.2)
    seen, base = set(), 0
    for mini in prepared.mini_batches:  # the rank's samples in order, mini-batch after mini-batch
        for mb in mini:
            offsets = mb.micro.response_offsets.tolist()
            for j, index in enumerate(mb.micro.sample_indices.tolist()):
                sample = base + index
                seen.add(sample)
                h = mb.old_entropy[offsets[j] : offsets[j + 1]].double().tolist()
                got = mb.advantages[offsets[j] : offsets[j + 1]].double().tolist()
                if sample < 4:  # all correct: α·H_t
                    want = [ALPHA * e for e in h]
                elif sample < 8:  # all wrong: −α·(max H − H_t)
                    want = [-ALPHA * (max(h) - e) for e in h]
                else:  # GRPO's advantage, untouched
                    want = [float(adv[sample])] * len(h)
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), sample
                if (sample < 4 and h) or (4 <= sample < 8 and len(h) > 1):  # (one token: max H − H = 0)
                    assert any(abs(g) > 1e-4 for g in got), (sample, h, got)
        base += sum(mb.num_samples for mb in mini)
    assert seen == set(range(12))
    step = worker.train(prepared)
    assert math.isfinite(step["train/loss"]) and step["train/grad_norm"] > 0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["trainer.compute_entropy=false", "algo.objective=ppo_clip", "algo.aggregation=token_mean"],
            "trainer.compute_entropy=true",
        ),
        (["algo.objective=dgo", "algo.aggregation=token_mean"], "algo.objective=dgo"),
    ],
)
def test_rules_refuse_what_shaping_cannot_run(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_trainer(tiny_recipe("algo.zero_variance_shaping=true", *overrides))
