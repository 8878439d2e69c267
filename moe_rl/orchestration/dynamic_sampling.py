"""Dynamic sampling (DAPO, `algo.dynamic_sampling`): the pool of groups a step's generation
rounds fill (`GroupPool`), in the reward worker."""

from __future__ import annotations

import math

from torch import Tensor

from moe_rl.data.trajectory import TrajectoryBatch


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
