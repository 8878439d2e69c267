"""Worker for tests/distributed/test_algo_dp.py: one data-parallel rank of a tiny linear policy.

The policy is ``logits = features @ W`` over a toy vocabulary; the loss is PPO-clip (with
token-TIS weights) or ESPO on packed responses of different lengths. Each rank holds whole
responses; the harness all-reduces the denominator (SUM) before dividing and the gradients
(SUM) after backward, as a trainer does.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from moe_rl.algo import aggregate, corrections, logprobs, objectives

HIDDEN, VOCAB = 8, 13
LENGTHS = [3, 7, 1, 5, 2, 6, 4]


def make_problem(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    return {
        "weight": torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64),
        "features": torch.randn(n, HIDDEN, generator=g, dtype=torch.float64),
        "tokens": torch.randint(0, VOCAB, (n,), generator=g),
        "old_shift": 0.3 * torch.randn(n, generator=g, dtype=torch.float64),
        "rollout_shift": 0.1 * torch.randn(n, generator=g, dtype=torch.float64),
        "advantages": torch.randn(len(LENGTHS), generator=g, dtype=torch.float64),
        "loss_mask": torch.rand(n, generator=g) > 0.25,
        "seq_ids": torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)),
    }


def shard(problem: dict, rank: int, world: int) -> dict:
    """Responses rank, rank+world, … (renumbered), so ranks hold different token counts."""
    seqs = list(range(rank, len(LENGTHS), world))
    keep = torch.isin(problem["seq_ids"], torch.tensor(seqs))
    out = {k: (v[keep] if v.dim() and v.shape[0] == keep.numel() else v) for k, v in problem.items()}
    out["advantages"] = problem["advantages"][seqs]
    remap = torch.full((len(LENGTHS),), -1, dtype=torch.long)
    remap[seqs] = torch.arange(len(seqs))
    out["seq_ids"] = remap[problem["seq_ids"][keep]]
    return out


def local_loss(batch: dict, weight: torch.Tensor, mode: str, global_denom=None):
    """(loss_sum, denom) on this rank's responses; `mode` is an aggregation or 'espo'."""
    num_seqs = len(batch["advantages"])
    logits = batch["features"] @ weight
    logp = logprobs.token_logprobs(logits, batch["tokens"], chunk_size=4)
    old_logp = logp.detach() + batch["old_shift"]
    rollout_logp = old_logp + batch["rollout_shift"]
    adv = batch["advantages"][batch["seq_ids"]]
    mask, seq = batch["loss_mask"], batch["seq_ids"]
    if mode == "espo":
        entropy = logprobs.token_entropy(logits.detach())
        return objectives.espo(
            logp, old_logp, adv, entropy, mask, seq, num_seqs=num_seqs, vocab_size=VOCAB,
            espo_alpha=2.0, global_denom=global_denom,
        )  # fmt: skip
    tis = corrections.token_tis(old_logp, rollout_logp, mask, cap=1.05)
    return objectives.ppo_clip(
        logp, old_logp, adv, mask, seq, num_seqs=num_seqs, weights=tis.weights,
        aggregation=mode, global_denom=global_denom, norm_len=8,
    )  # fmt: skip


def reference_grad(mode: str) -> torch.Tensor:
    """DP = 1: the whole batch on one rank."""
    problem = make_problem()
    weight = problem["weight"].clone().requires_grad_()
    out = local_loss(problem, weight, mode)
    (out.loss_sum / out.denom).backward()
    return weight.grad


def rank_main(rank: int, world: int, port: int, modes: list[str], out_dir: str) -> None:
    """Run every mode on this rank's shard; save the all-reduced gradient to ``out_dir/{mode}.{rank}.pt``."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        batch = shard(make_problem(), rank, world)
        for mode in modes:
            torch.save(dp_grad(batch, mode), f"{out_dir}/{mode}.{rank}.pt")
    finally:
        dist.destroy_process_group()


def dp_grad(batch: dict, mode: str) -> torch.Tensor:
    """Global denominator = all-reduced local counts; gradient = all-reduced (SUM) local gradients."""
    weight = batch["weight"].clone().requires_grad_()
    if mode == "espo":
        denom = local_loss(batch, weight, mode).denom.detach().clone()
    else:
        num_seqs = len(batch["advantages"])
        denom = aggregate.local_denominator(
            batch["loss_mask"], batch["seq_ids"], num_seqs=num_seqs, mode=mode
        )
    dist.all_reduce(denom)  # SUM over data-parallel ranks
    out = local_loss(batch, weight, mode, global_denom=denom)
    (out.loss_sum / out.denom).backward()
    grad = weight.grad.clone()
    dist.all_reduce(grad)  # SUM, not AVG: the global denominator already averages
    return grad
