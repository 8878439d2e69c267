"""Rollout batches between the engine pool and the trainer group, without passing through the driver.

* `dispatch`: a step's prompts over the engine replicas by token load (a prompt's ``n`` samples
  stay on one replica), and the permutation that merges the replicas' batches back into prompt
  order.
* `step_spec`, `step_advantages`, `step_zero_variance`: a step's sampling, its advantages and the
  RL-ZVP signs of its zero-variance groups (the driver's math, shared with the in-process loop of
  `moe_rl.orchestration.local`).
* `prepare`: what the reward worker does with the replicas' batches: merge, score, validate, check
  staleness, split into mini-batches and token-balanced data-parallel shards
  (`moe_rl.data.packing.plan_shards`; each trainer rank fetches its own by object reference) and summarize what the driver needs (rewards, group ids, lengths, versions):
  a few numbers per sample, never the tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from moe_rl.algo import registry
from moe_rl.algo.advantages import zero_variance_groups, zero_variance_signs
from moe_rl.algo.modes import Objective
from moe_rl.algo.objectives import dgo_weights
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.packing import RankShare, ShardPlan, plan_shards
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.data.validate import check_staleness, validate
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec


@dataclass(frozen=True)
class Dispatch:
    """Which prompts each replica generates (ascending prompt indices per replica)."""

    assignment: list[list[int]]
    group_size: int

    @property
    def num_prompts(self) -> int:
        return sum(len(a) for a in self.assignment)

    def merge_order(self) -> Tensor:
        """Indices into the replicas' batches concatenated (replica 0 first) that put the samples
        in prompt order: prompt p's ``n`` samples at ``[p·n, (p+1)·n)``."""
        n = self.group_size
        where: dict[int, int] = {}
        offset = 0
        for prompts in self.assignment:
            for j, prompt in enumerate(prompts):
                where[prompt] = offset + j * n
            offset += len(prompts) * n
        return torch.tensor(
            [where[p] + k for p in range(self.num_prompts) for k in range(n)], dtype=torch.int64, device="cpu"
        )


def dispatch(prompt_lengths: Sequence[int], n: int, max_new_tokens: int, replicas: int) -> Dispatch:
    """Longest-processing-time assignment of prompts to replicas by their token load
    ``n · (prompt length + max_new_tokens)``; every replica gets at least one prompt when there are
    enough prompts."""
    if replicas < 1:
        raise ValueError(f"rollout.num_engines={replicas} must be >= 1")
    heap = [(0, r) for r in range(replicas)]
    assignment: list[list[int]] = [[] for _ in range(replicas)]
    order = sorted(range(len(prompt_lengths)), key=lambda i: (-prompt_lengths[i], i))
    for i in order:
        load, r = heapq.heappop(heap)
        assignment[r].append(i)
        heapq.heappush(heap, (load + n * (prompt_lengths[i] + max_new_tokens), r))
    return Dispatch([sorted(a) for a in assignment], n)


REPLICA_SEED_STRIDE = 1_000_003
"""Replica r samples with the step's seed + r · stride (one replica: the step's seed)."""


def replica_spec(spec: SamplingSpec, replica: int) -> SamplingSpec:
    """The sampling of replica ``replica`` in a step (its own seed, `REPLICA_SEED_STRIDE`)."""
    return replace(spec, seed=None if spec.seed is None else spec.seed + replica * REPLICA_SEED_STRIDE)


def merge(batches: Sequence[TrajectoryBatch], plan: Dispatch) -> TrajectoryBatch:
    """The replicas' batches (one per non-empty replica, in replica order) in prompt order."""
    present = [b for b in batches if b is not None]
    return TrajectoryBatch.concat(present).select(plan.merge_order())


@dataclass
class Replica:
    index: int
    actor: Any = None
    restarts: int = 0


@dataclass
class Generation:
    """A generation in flight: per replica its prompts and ``(batch ref, status ref)``."""

    plan: Dispatch
    prompts: list[Prompt]
    spec: SamplingSpec
    group_ids: list[int]
    refs: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per replica, what its ``generate`` reported (samples, environment counts)."""


@dataclass(frozen=True)
class OldLogp:
    """A step's batch after the π_old pass on every trainer rank: its ``old/*`` metrics, and the
    handle under which the ranks keep the prepared batch until `TrainerGroup.train` takes it."""

    handle: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class RankPart:
    """What one data-parallel rank trains on in a step: its shard of the batch (in the object
    store, fetched by the rank), its samples' advantages (and RL-ZVP signs) and its share of the
    mini-batch plan (`moe_rl.trainer.batch.TrainerBatch.of_share`)."""

    trajectories: Any
    """The shard's `TrajectoryBatch`, or an object reference to it."""
    advantages: Tensor
    share: RankShare
    zvp_signs: Tensor | None = None


def rank_parts(
    plan: ShardPlan, shards: Sequence[Any], advantages: Tensor, zvp_signs: Tensor | None
) -> list[RankPart]:
    """Per data-parallel rank, its `RankPart`: the one place that reads the plan's layout."""
    return [
        RankPart(shard, advantages[idx], plan.rank(dp), None if zvp_signs is None else zvp_signs[idx])
        for dp, (shard, idx) in enumerate(zip(shards, plan.indices, strict=True))
    ]


@dataclass
class Prepared:
    """What the driver learns about a scored rollout batch (the batch itself stays in the store)."""

    num_samples: int
    rewards: Tensor
    group_ids: Tensor
    plan: ShardPlan | None
    """Mini-batches and data-parallel shards (None for a stale batch: nothing to train on)."""
    min_version: int
    stale: str | None = None
    """Why the batch is too stale to train on (then there are no shards)."""
    more: int = 0
    """Dynamic sampling: prompts to generate in another round before the batch is full (then there
    are no shards)."""
    metrics: dict[str, float] = field(default_factory=dict)


def length_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    lengths = batch.response_lengths().float()
    stops = sum(r == "stop" for r in batch.finish_reasons)
    out = {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/stop_share": stops / batch.num_samples,
        "rollout/samples": batch.num_samples,
        "rollout/tokens": int(lengths.sum()),
        # responses sampled by more than one policy version (a sync landed while they were decoded)
        "rollout/mixed_version_share": float(
            (batch.sample_max_versions() != batch.sample_min_versions()).float().mean()
        ),
    }
    if batch.sampled is not None:  # multi-turn: who wrote the response tokens
        sampled = int(batch.sampled.sum())
        out["rollout/sampled_tokens"] = sampled
        out["rollout/env_tokens"] = batch.num_response_tokens - sampled
    return out


def engine_metrics(batches: Sequence[TrajectoryBatch | None]) -> dict[str, float]:
    """Tokens (prompt + response) each replica generated, and the spread between them."""
    tokens = [0 if b is None else int(b.sequence_lengths().sum()) for b in batches]
    out = {f"rollout/tokens_engine{r}": float(t) for r, t in enumerate(tokens)}
    out["rollout/engine_token_imbalance"] = max(tokens) / max(1.0, sum(tokens) / len(tokens)) - 1
    return out


def prepare(
    batch: TrajectoryBatch, rewards: Sequence[float], version: int, max_staleness: int, *,
    vocab_size: int, dp_size: int, max_tokens_per_microbatch: int, num_mini_batches: int,
) -> tuple[TrajectoryBatch, Prepared]:  # fmt: skip
    """Score, validate, check staleness and shard one merged batch (see the module docstring)."""
    batch = batch.replace(rewards=torch.tensor(list(rewards), dtype=torch.float32, device="cpu"))
    validate(batch, vocab_size=vocab_size)
    summary = Prepared(
        num_samples=batch.num_samples, rewards=batch.rewards, group_ids=batch.group_ids, plan=None,
        min_version=batch.min_policy_version(), metrics=length_metrics(batch),
    )  # fmt: skip
    try:
        check_staleness(batch, version, max_staleness)
    except TrajectoryError as exc:
        summary.stale = str(exc)
        return batch, summary
    summary.plan = plan_shards(batch, dp_size, max_tokens_per_microbatch, num_mini_batches)
    return batch, summary


ROUND_SEED_STRIDE = 1_000_003
"""Seed distance between a step's generation rounds (dynamic sampling), beyond any step count."""


def step_spec(config: RecipeConfig, step: int, round_: int = 0) -> SamplingSpec:
    """The sampling of step ``step`` (its generation round ``round_``): the recipe's, seeded by run,
    step and round, stopping at EOS."""
    eos = config.model.eos_token_id
    return replace(
        SamplingSpec.from_rollout(config.rollout),
        seed=config.run.seed * 100_003 + step + ROUND_SEED_STRIDE * round_,
        stop_token_ids=() if eos is None else (eos,),
    )


def step_scorer(config: RecipeConfig):
    """What scores a step's responses: `data.reward`'s scorer, or None with an environment
    (`env.name`), whose rewards the multi-turn rollout has put in the batch already."""
    from moe_rl.rewards.registry import build_scorer

    return None if config.env.name else build_scorer(config)


def step_rewards(scorer, batch: TrajectoryBatch, prompts: Sequence, group_size: int) -> list[float]:
    """The rewards of a rollout batch in prompt order (``group_size`` responses per prompt): the
    scorer's, or the environments' already in the batch (`step_scorer` gave None)."""
    if scorer is None:
        return batch.rewards.tolist()
    per_sample = [p for p in prompts for _ in range(group_size)]
    return scorer.score_all(per_sample, [s.response_ids.tolist() for s in batch.samples()])


def step_advantages(
    config: RecipeConfig, rewards: Tensor, group_ids: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Per-sample advantages of a scored batch (for DGO the weights exp(r/β)/mean_group exp(r/β)),
    with the zero-variance group counts."""
    if config.algo.objective == Objective.DGO:
        adv = dgo_weights(rewards, group_ids, dgo_beta=config.algo.dgo_beta)
    else:
        adv = registry.bind_advantage(config.algo.advantage)(rewards=rewards, group_ids=group_ids)
    metrics = {
        f"advantage/{k}": float(v) for k, v in zero_variance_groups(rewards, group_ids).metrics().items()
    }
    metrics["advantage/abs_mean"] = float(adv.abs().mean())
    return adv, metrics


def step_zero_variance(config: RecipeConfig, rewards: Tensor, group_ids: Tensor) -> Tensor | None:
    """Per-sample RL-ZVP signs of a scored batch (`moe_rl.algo.advantages.zero_variance_signs`)
    when `algo.zero_variance_shaping` is on, else None. Each trainer rank turns the signs of its
    samples into token advantages once π_old's entropy is known."""
    if not config.algo.zero_variance_shaping:
        return None
    return zero_variance_signs(rewards, group_ids)


class GroupPool:
    """Dynamic sampling (DAPO) over the generation rounds of one step: the groups whose rewards
    differ are kept, in the order they came; groups whose rewards are all equal are set aside. The
    batch is full once ``target`` groups are kept; after the last round a short batch takes as many
    set-aside groups as it lacks, and groups kept beyond ``target`` are dropped."""

    def __init__(self, target: int, group_size: int):
        self.target, self.group_size = target, group_size
        self.kept: list[TrajectoryBatch] = []
        self.flat: list[TrajectoryBatch] = []
        self.num_kept = self.generated = self.rounds = 0

    def add(self, batch: TrajectoryBatch) -> None:
        """A scored round (rewards set, groups contiguous in prompt order)."""
        n = self.group_size
        rewards = batch.rewards.view(-1, n)
        varied = (rewards.amax(1) != rewards.amin(1)).tolist()
        keep = [g * n + k for g, v in enumerate(varied) if v for k in range(n)]
        drop = [g * n + k for g, v in enumerate(varied) if not v for k in range(n)]
        if keep:
            self.kept.append(batch.select(keep))
        if drop:
            self.flat.append(batch.select(drop))
        self.num_kept += sum(varied)
        self.generated += len(varied)
        self.rounds += 1

    def prompts_wanted(self) -> int:
        """Prompts to draw for the next round: the groups still missing over the share of groups
        kept so far (all of a batch while none was), at most a batch's worth, at least the missing."""
        missing = self.target - self.num_kept
        if missing <= 0:
            return 0
        if self.num_kept == 0:
            return self.target
        return min(self.target, max(missing, math.ceil(missing * self.generated / self.num_kept)))

    def take(self, group_ids: Tensor) -> tuple[TrajectoryBatch, dict[str, float]]:
        """The step's batch of ``target`` groups, numbered ``group_ids`` (one per group), and what
        dynamic sampling did."""
        n = self.group_size
        kept = (
            TrajectoryBatch.concat(self.kept).slice(0, min(self.num_kept, self.target) * n)
            if self.kept
            else None
        )
        short = max(0, self.target - self.num_kept)
        filled = TrajectoryBatch.concat(self.flat).slice(0, short * n) if short else None
        batch = TrajectoryBatch.concat([b for b in (kept, filled) if b is not None])
        batch = batch.replace(group_ids=group_ids.repeat_interleave(n))
        metrics = {
            "sampling/rounds": self.rounds,
            "sampling/generated_groups": self.generated,
            "sampling/dropped_group_share": 1.0 - self.num_kept / self.generated,
            "sampling/flat_kept_groups": short,
            "sampling/surplus_groups": max(0, self.num_kept - self.target),
        }
        return batch, metrics


class Rewarder:
    """The reward worker's work, wherever it runs (a Ray actor of its own, `moe_rl.orchestration.
    actors.RewardActor`, or the one-process loop): merge the replicas' batches in prompt order,
    score, validate, check staleness and shard; keep the last prepared batch for `dump`."""

    def __init__(self, config: RecipeConfig, scorer=None):
        """``scorer``: the scorer the preflight built (`data.reward`; built here when not given,
        None with an environment, whose rewards are in the batch)."""
        self.config = config
        self.scorer = scorer if scorer is not None else step_scorer(config)
        self._last: TrajectoryBatch | None = None
        self._pool: GroupPool | None = None

    def prepare(
        self, parts: Sequence[TrajectoryBatch], plan: Dispatch, prompts: Sequence, version: int, dp_size: int,
        round_: int = 0, group_ids: Sequence[int] = (),
    ) -> tuple[list[TrajectoryBatch], Prepared]:  # fmt: skip
        """``(shards, summary)`` of the replicas' batches; the summary is all the driver reads.
        With `algo.dynamic_sampling`, ``round_`` is the step's generation round (0 starts the
        step's pool) and ``group_ids`` the numbers of the step's groups; a batch not yet full
        answers with no shards and the prompts to generate next (`Prepared.more`)."""
        batch = merge(parts, plan)
        rewards = step_rewards(self.scorer, batch, prompts, plan.group_size)
        algo = self.config.algo
        if not algo.dynamic_sampling:
            return self._shard(batch, rewards, version, dp_size, engine_metrics(parts))
        r = self.config.rollout
        if round_ == 0 or self._pool is None:
            self._pool = GroupPool(r.batch_size // r.group_size, r.group_size)
        self._pool.add(batch.replace(rewards=torch.tensor(list(rewards), dtype=torch.float32, device="cpu")))
        more = self._pool.prompts_wanted()
        if more and round_ + 1 < algo.dynamic_sampling_rounds:
            empty = torch.zeros(0)
            return [], Prepared(0, empty, empty.long(), None, batch.min_policy_version(), more=more)
        batch, sampled = self._pool.take(torch.as_tensor(list(group_ids), dtype=torch.int64))
        self._pool = None
        return self._shard(
            batch, batch.rewards.tolist(), version, dp_size, {**engine_metrics(parts), **sampled}
        )

    def prepare_stored(
        self, batch: TrajectoryBatch, version: int, dp_size: int
    ) -> tuple[list[TrajectoryBatch], Prepared]:
        """A stored batch (offline DGO, rewards already in it): validate and shard."""
        return self._shard(batch, batch.rewards.tolist(), version, dp_size, {}, staleness=10**9)

    def _shard(self, batch, rewards, version: int, dp_size: int, extra: dict, staleness: int | None = None):
        t = self.config.trainer
        batch, summary = prepare(
            batch, rewards, version, self.config.run.max_staleness if staleness is None else staleness,
            vocab_size=self.config.model.vocab_size, dp_size=dp_size,
            max_tokens_per_microbatch=t.max_tokens_per_microbatch, num_mini_batches=t.num_mini_batches,
        )  # fmt: skip
        summary.metrics.update(extra)
        self._last = batch
        shards = [] if summary.plan is None else [batch.select(idx) for idx in summary.plan.indices]
        return shards, summary

    def dump(self, folder: str, step: int) -> None:
        """Write the last prepared batch as trajectory shards (`logging.dump_trajectories`)."""
        from moe_rl.data.shards import write_shards

        batch = self._last
        write_shards([batch], folder, max_samples_per_shard=batch.num_samples, metadata={"step": step})
