"""A step's prompts over the engine replicas: which replica generates which prompts (`dispatch`,
by token load, a prompt's ``n`` samples on one replica), the generation in flight (`Generation`),
and the permutation that merges the replicas' batches back into prompt order (`merge`)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.orchestration.sampling import Draw
from moe_rl.rewards.tasks import Prompt


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


def merge(batches: Sequence[TrajectoryBatch], plan: Dispatch) -> TrajectoryBatch:
    """The replicas' batches (one per non-empty replica, in replica order) in prompt order."""
    present = [b for b in batches if b is not None]
    return TrajectoryBatch.concat(present).select(plan.merge_order())


@dataclass
class Generation:
    """A generation in flight: per replica its prompts and ``(batch ref, status ref)``."""

    plan: Dispatch
    prompts: list[Prompt]
    draw: Draw
    """What the round samples for (its replicas' seeds: `moe_rl.orchestration.sampling.replica_spec`)."""
    group_ids: list[int]
    refs: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per replica, what its ``generate`` reported (samples, environment counts)."""

    def part(self, replica: int) -> tuple[list[Prompt], list[int]]:
        """Replica ``replica``'s prompts and their group numbers, as the plan assigned them (empty:
        none)."""
        mine = self.plan.assignment[replica]
        return [self.prompts[i] for i in mine], [self.group_ids[i] for i in mine]

    def batch_refs(self) -> list[Any]:
        """The replicas' batches (or their refs) in replica order, the empty ones left out."""
        return [self.refs[r][0] for r in sorted(self.refs)]
