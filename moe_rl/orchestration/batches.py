"""The reward worker's work on a step's rollout batch, wherever it runs (a Ray actor of its own,
`moe_rl.orchestration.actors.RewardActor`, or the one-process loop): `Rewarder` merges the
replicas' batches in prompt order, scores every response, validates the batch, checks its
staleness, plans its mini-batches and token-balanced data-parallel shards
(`moe_rl.data.packing.plan_shards`; each trainer rank fetches its own by object reference) and
summarises what the driver needs (`ScoredSummary`: rewards, group ids, lengths, versions). With
dynamic sampling it fills the step's pool of groups round by round
(`moe_rl.orchestration.dynamic_sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moe_rl.config.schema import RecipeConfig
from moe_rl.data.errors import TrajectoryError
from moe_rl.data.packing import ShardPlan, plan_shards
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.data.validate import check_staleness, validate
from moe_rl.orchestration.dispatch import Dispatch, merge
from moe_rl.orchestration.dynamic_sampling import GroupPool

if TYPE_CHECKING:
    from moe_rl.rewards.registry import Scores


@dataclass
class ScoredSummary:
    """What the driver learns about a scored rollout batch (the batch itself stays with the reward
    worker, or in the object store): a few numbers per sample, never the tokens."""

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
    scored: int = 0
    """Which of the reward worker's scored batches this is (1, 2, ...; 0: none was sharded), for
    `Rewarder.dump`."""

    @property
    def trainable(self) -> bool:
        """The batch is complete and fresh enough to train on: its shards are planned."""
        return self.plan is not None


def length_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    """Response lengths, stop share, token counts and the share of responses more than one policy
    version sampled; multi-turn, the tokens the model and the environments wrote."""
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


def validate_and_plan(
    batch: TrajectoryBatch, rewards: Sequence[float], version: int, max_staleness: int, *,
    vocab_size: int, dp_size: int, max_tokens_per_microbatch: int, num_mini_batches: int,
) -> tuple[TrajectoryBatch, ScoredSummary]:  # fmt: skip
    """One merged batch with its ``rewards``: validated (against the vocabulary), checked for
    staleness, and planned into mini-batches and data-parallel shards (none for a stale batch)."""
    batch = batch.replace(rewards=torch.tensor(list(rewards), dtype=torch.float32, device="cpu"))
    validate(batch, vocab_size=vocab_size)
    summary = ScoredSummary(
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


def step_scorer(config: RecipeConfig):
    """What scores a step's responses: `data.reward`'s scorer, or None with an environment
    (`env.name`), whose rewards the multi-turn rollout has put in the batch already."""
    from moe_rl.rewards.registry import build_scorer

    return None if config.env.name else build_scorer(config)


def step_rewards(scorer, batch: TrajectoryBatch, prompts: Sequence, group_size: int) -> Scores:
    """The rewards of a rollout batch in prompt order (``group_size`` responses per prompt): the
    scorer's, or the environments' already in the batch (`step_scorer` gave None)."""
    from moe_rl.rewards.registry import Scores

    if scorer is None:
        return Scores(batch.rewards.tolist())
    per_sample = [p for p in prompts for _ in range(group_size)]
    return scorer.score_batch(per_sample, [s.response_ids.tolist() for s in batch.samples()], group_size)


class Rewarder:
    """The reward worker's work, wherever it runs (a Ray actor of its own, `moe_rl.orchestration.
    actors.RewardActor`, or the one-process loop): merge the replicas' batches in prompt order,
    score, validate, check staleness and shard; keep the last sharded batch for `dump`."""

    def __init__(self, config: RecipeConfig, scorer=None):
        """``scorer``: the scorer the preflight built (`data.reward`; built here when not given,
        None with an environment, whose rewards are in the batch)."""
        self.config = config
        self.scorer = scorer if scorer is not None else step_scorer(config)
        self._last: tuple[int, TrajectoryBatch] | None = None
        """The batch sharded last, with its number (`ScoredSummary.scored`), for `dump`."""
        self._scored = 0
        self._pool: GroupPool | None = None
        self._failed = 0
        """Responses of the step scored 0 because their reward call failed (`reward/failed`)."""

    def prepare(
        self, batches: Sequence[TrajectoryBatch], plan: Dispatch, prompts: Sequence, version: int, dp_size: int,
        round_: int = 0, group_ids: Sequence[int] = (),
    ) -> tuple[list[TrajectoryBatch], ScoredSummary]:  # fmt: skip
        """``(shards, summary)`` of the replicas' ``batches``; the summary is all the driver reads.
        With `algo.dynamic_sampling`, ``round_`` is the step's generation round (0 starts the
        step's pool) and ``group_ids`` the numbers of the step's groups; a batch not yet full
        answers with no shards and the prompts to generate next (`ScoredSummary.more`)."""
        batch = merge(batches, plan)
        scores = step_rewards(self.scorer, batch, prompts, plan.group_size)
        rewards = scores.values
        self._failed = scores.failed + (self._failed if round_ else 0)  # over the step's rounds
        scored = {"reward/failed": self._failed} if scores.counted else {}
        algo = self.config.algo
        if not algo.dynamic_sampling:
            return self._shard(batch, rewards, version, dp_size, {**engine_metrics(batches), **scored})
        r = self.config.rollout
        if round_ == 0 or self._pool is None:
            self._pool = GroupPool(r.batch_size // r.group_size, r.group_size)
        self._pool.add(batch.replace(rewards=torch.tensor(list(rewards), dtype=torch.float32, device="cpu")))
        more = self._pool.prompts_wanted()
        if more and round_ + 1 < algo.dynamic_sampling_rounds:
            empty = torch.zeros(0)
            return [], ScoredSummary(0, empty, empty.long(), None, batch.min_policy_version(), more=more)
        batch, sampled = self._pool.take(torch.as_tensor(list(group_ids), dtype=torch.int64))
        self._pool = None
        return self._shard(
            batch, batch.rewards.tolist(), version, dp_size, {**engine_metrics(batches), **sampled, **scored}
        )

    def prepare_stored(
        self, batch: TrajectoryBatch, version: int, dp_size: int
    ) -> tuple[list[TrajectoryBatch], ScoredSummary]:
        """A stored batch (offline DGO, rewards already in it): validate and shard."""
        return self._shard(batch, batch.rewards.tolist(), version, dp_size, {}, staleness=10**9)

    def _shard(self, batch, rewards, version: int, dp_size: int, extra: dict, staleness: int | None = None):
        t = self.config.trainer
        batch, summary = validate_and_plan(
            batch, rewards, version, self.config.run.max_staleness if staleness is None else staleness,
            vocab_size=self.config.model.vocab_size, dp_size=dp_size,
            max_tokens_per_microbatch=t.max_tokens_per_microbatch, num_mini_batches=t.num_mini_batches,
        )  # fmt: skip
        summary.metrics.update(extra)
        self._scored += 1
        summary.scored, self._last = self._scored, (self._scored, batch)
        shards = [] if summary.plan is None else [batch.select(idx) for idx in summary.plan.indices]
        return shards, summary

    def progress(self) -> str | None:
        """Where the scoring in progress stands (None: none is); asked from another thread."""
        return None if self.scorer is None else self.scorer.progress_line()

    def shutdown(self) -> None:
        """End the scorer's worker processes, if any."""
        if self.scorer is not None:
            self.scorer.close()

    def dump(self, folder: str, step: int, scored: int) -> None:
        """Write the batch of `ScoredSummary.scored` ``scored`` as trajectory shards (the reward worker
        keeps the one it sharded last; an earlier one is refused)."""
        from moe_rl.data.shards import write_shards

        if self._last is None or self._last[0] != scored:
            held = "none" if self._last is None else f"batch {self._last[0]}"
            raise ValueError(
                f"scored batch {scored} is no longer held by the reward worker (it holds {held})"
            )
        batch = self._last[1]
        write_shards([batch], folder, max_samples_per_shard=batch.num_samples, metadata={"step": step})
