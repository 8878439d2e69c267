"""What the trainer consumes, and what its π_old pass hands to its update.

* `TrainerBatch`: one rank's share of a rollout batch, with everything the rank needs attached:
  its samples (a CPU trajectory, mini-batch after mini-batch), each sample's advantage (and RL-ZVP
  sign), and how many samples and micro-batches each mini-batch has (`moe_rl.data.packing.
  ShardPlan`). The driver builds one per data-parallel rank; a rank reads nothing else.
* `TrainMicroBatch`: a packed `moe_rl.data.packing.MicroBatch` plus the per-token inputs of the
  loss: the advantages, and what the π_old pass computes (old log-probs, the old policy's entropy,
  the reference policy's log-probs for the KL penalty, recorded routing for R2). Passes never edit
  one: the π_old pass returns new micro-batches with its results (`TrainMicroBatch.with_old`).
* `PreparedBatch`: a rank batch after the π_old pass, mini-batch after mini-batch; what an update
  consumes (`moe_rl.trainer.worker.TrainerWorker.train`).

Alignment: ``T`` packed tokens (``input_ids``, ``position_ids``, ``loss_mask``, routing rows),
``R`` response tokens in packed order (``rollout_logp``, ``advantages``, ``old_logp``, the
sampling-mask rows). ``micro.response_positions[r]`` is where response token ``r`` sits; its
log-prob comes from the logits at ``response_positions[r] - 1``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.data.packing import MicroBatch, RankShare, pack_microbatches, plan_shards
from moe_rl.data.trajectory import TrajectoryBatch


@dataclass
class TrainMicroBatch:
    """One packed micro-batch with everything the log-prob passes and the loss need."""

    micro: MicroBatch
    advantages: Tensor
    """float32 ``[R]``: advantage of every response token (per-sample advantages broadcast, or
    per-token ones such as RL-ZVP's)."""
    old_logp: Tensor | None = None
    """float32 ``[R]``: π_old log-probs (the π_old pass's, or carried by the trajectory)."""
    old_entropy: Tensor | None = None
    """float32 ``[R]``: full-vocabulary entropy of π_old at each response token (ESPO, RL-ZVP)."""
    ref_logp: Tensor | None = None
    """float32 ``[R]``: log-probs of the reference policy (the KL penalty's π_ref), computed in the
    π_old pass under the same routing and kept sets as ``old_logp``."""
    recorded_routing: Tensor | None = None
    """int64 ``[T, local MoE layers, k]``: the trainer's own routing in the π_old pass (R2)."""
    old_weights_version: int | None = None
    """Optimizer steps the trainer had taken when it computed ``old_logp``."""
    old_routing_metrics: dict | None = None
    """Routing agreement of the π_old pass (trainer-natural vs replayed routing)."""
    old_values: Tensor | None = None
    """float32 ``[R]``: the critic's values at each response token's state, from the π_old pass
    (``algo.advantage=gae``)."""
    returns: Tensor | None = None
    """float32 ``[R]``: the critic's regression target (GAE's λ-returns), from the π_old pass."""
    teacher_logp: Tensor | None = None
    """float32 ``[R]``: the distillation teacher's log-probs of the response tokens (π_old pass)."""
    zvp_sign: Tensor | None = None
    """int8 ``[S]``: RL-ZVP sign of each sample of this micro-batch (+1 all-correct zero-variance
    group, −1 all-wrong, 0 other); the π_old pass shapes ``advantages`` with it once π_old's
    entropy is known (`moe_rl.algo.advantages.zvp_shape`)."""

    def __post_init__(self) -> None:
        num_resp = self.micro.response_positions.numel()
        if self.advantages.dim() != 1 or self.advantages.numel() != num_resp:
            raise ValueError(
                f"advantages must be [R] = [{num_resp}] (one per response token), "
                f"got shape {tuple(self.advantages.shape)}"
            )
        if not torch.is_floating_point(self.advantages) or not bool(torch.isfinite(self.advantages).all()):
            raise ValueError("advantages must be finite floats")

    @property
    def num_samples(self) -> int:
        return self.micro.cu_seqlens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.micro.device

    def to(self, device: torch.device | str) -> TrainMicroBatch:
        """This micro-batch with every tensor on ``device`` (the worker's boundary: trajectories
        arrive as CPU tensors and are moved once); itself when everything is there already."""
        device = torch.device(device)
        moved = {
            name: getattr(self, name).to(device)
            for name in _TENSOR_FIELDS
            if getattr(self, name) is not None and getattr(self, name).device != device
        }
        micro = self.micro.to(device)
        if not moved and micro is self.micro:
            return self
        return self._copy(micro=micro, **moved)

    def with_old(self, **computed) -> TrainMicroBatch:
        """A new micro-batch with what the π_old pass computed (``old_logp``, ``old_entropy``,
        ``ref_logp``, ``recorded_routing``, ``advantages`` shaped by RL-ZVP, ...)."""
        unknown = set(computed) - _OLD_FIELDS
        if unknown:
            raise ValueError(f"the π_old pass computes {sorted(_OLD_FIELDS)}, not {sorted(unknown)}")
        return self._copy(**computed)

    def _copy(self, **fields) -> TrainMicroBatch:
        """A copy with ``fields`` replaced, not checked again (they come from this one's checked
        inputs: moved, or computed by a pass)."""
        out = copy.copy(self)
        for name, value in fields.items():
            setattr(out, name, value)
        return out

    @property
    def seq_ids(self) -> Tensor:
        """int64 ``[R]``: index of each response token's sample inside this micro-batch."""
        counts = self.micro.response_offsets[1:] - self.micro.response_offsets[:-1]
        samples = torch.arange(self.num_samples, device=counts.device)
        return torch.repeat_interleave(samples, counts, output_size=self.micro.response_positions.numel())

    @property
    def sample_of_token(self) -> Tensor:
        """int64 ``[T]``: source-batch index of the sample owning each packed token (for errors)."""
        lengths = (self.micro.cu_seqlens[1:] - self.micro.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(self.micro.sample_indices, lengths, output_size=self.micro.num_tokens)


_TENSOR_FIELDS = (
    "advantages", "old_logp", "old_entropy", "ref_logp", "recorded_routing", "old_values", "returns", "teacher_logp",
    "zvp_sign",
)  # fmt: skip
_OLD_FIELDS = {
    "advantages", "old_logp", "old_entropy", "ref_logp", "recorded_routing", "old_weights_version",
    "old_routing_metrics", "old_values", "returns", "teacher_logp",
}  # fmt: skip


def token_advantages(sample_advantages: Tensor, response_lengths: Tensor) -> Tensor:
    """Per-sample advantages ``[S]`` broadcast over each sample's response tokens -> ``[ΣR]``."""
    return torch.repeat_interleave(sample_advantages.to(torch.float32), response_lengths.long())


def make_train_micro_batches(
    batch: TrajectoryBatch,
    advantages: Tensor,
    max_tokens_per_microbatch: int,
    num_microbatches: int | None = None,
    zvp_signs: Tensor | None = None,
) -> list[TrainMicroBatch]:
    """Pack ``batch`` and attach advantages.

    ``advantages`` is per sample ``[S]`` or per response token ``[ΣR]`` (flat, in the batch's
    response order); ``old_logp`` already present in the batch is carried over. ``zvp_signs``
    (per sample ``[S]``, RL-ZVP) goes with each micro-batch's samples.
    """
    num_resp = int(batch.response_lengths().sum())
    if advantages.numel() == batch.num_samples and num_resp != batch.num_samples:
        advantages = token_advantages(advantages, batch.response_lengths())
    if advantages.numel() != num_resp:
        raise ValueError(
            f"advantages must have one value per sample ({batch.num_samples}) or per response token "
            f"({num_resp}), got {advantages.numel()}"
        )
    if zvp_signs is not None and zvp_signs.numel() != batch.num_samples:
        raise ValueError(
            f"zvp_signs must have one value per sample ({batch.num_samples}), got {zvp_signs.numel()}"
        )
    signs = None if zvp_signs is None else zvp_signs.to(torch.int8)
    micro = pack_microbatches(batch, max_tokens_per_microbatch, num_microbatches=num_microbatches)
    return [
        TrainMicroBatch(
            m,
            advantages[m.response_token_index].to(torch.float32),
            old_logp=m.old_logp,
            zvp_sign=None if signs is None else signs[m.sample_indices],
        )
        for m in micro
    ]


@dataclass(frozen=True)
class TrainerBatch:
    """One rank's share of a rollout batch (see the module docstring)."""

    trajectories: TrajectoryBatch
    """This rank's samples, mini-batch after mini-batch (CPU tensors)."""
    advantages: Tensor
    """float32 ``[S]``: each sample's advantage (DGO: its weight)."""
    samples_per_mini_batch: tuple[int, ...]
    """This rank's sample count in each mini-batch (one optimizer step each)."""
    micro_batches_per_mini_batch: tuple[int, ...]
    """Micro-batches each mini-batch is packed into (equal on every rank: expert-parallel ranks
    meet in collectives in every forward)."""
    zvp_signs: Tensor | None = None
    """int8 ``[S]``: RL-ZVP signs of the samples (`algo.zero_variance_shaping`), else None."""

    def __post_init__(self) -> None:
        num = self.trajectories.num_samples
        if sum(self.samples_per_mini_batch) != num or self.advantages.numel() != num:
            raise ValueError(
                f"a rank's share lists {sum(self.samples_per_mini_batch)} samples, its batch has {num} and "
                f"{self.advantages.numel()} advantages"
            )
        if len(self.micro_batches_per_mini_batch) != len(self.samples_per_mini_batch):
            raise ValueError(
                f"{len(self.samples_per_mini_batch)} mini-batches but micro-batch counts for "
                f"{len(self.micro_batches_per_mini_batch)}"
            )
        if self.zvp_signs is not None and self.zvp_signs.numel() != num:
            raise ValueError(
                f"zvp_signs must have one value per sample ({num}), got {self.zvp_signs.numel()}"
            )

    @classmethod
    def of_share(
        cls,
        trajectories: TrajectoryBatch,
        advantages: Tensor,
        share: RankShare,
        zvp_signs: Tensor | None = None,
    ) -> TrainerBatch:
        """A rank's batch from its shard of the trajectories and its `RankShare` of the plan."""
        return cls(trajectories, advantages, tuple(share.samples), tuple(share.micro_batches), zvp_signs)

    @classmethod
    def whole(
        cls, trajectories: TrajectoryBatch, advantages: Tensor, max_tokens_per_microbatch: int,
        num_mini_batches: int, zvp_signs: Tensor | None = None,
    ) -> TrainerBatch:  # fmt: skip
        """The whole rollout batch as the batch of a one-rank trainer."""
        plan = plan_shards(trajectories, 1, max_tokens_per_microbatch, num_mini_batches)
        return cls.of_share(trajectories, advantages, plan.rank(0), zvp_signs)

    @property
    def num_samples(self) -> int:
        return self.trajectories.num_samples

    def mini_batches(self, max_tokens_per_microbatch: int) -> list[list[TrainMicroBatch]]:
        """Each mini-batch packed into its micro-batches, advantages (and signs) attached."""
        out, start = [], 0
        for size, count in zip(self.samples_per_mini_batch, self.micro_batches_per_mini_batch):
            part, adv = self.trajectories.slice(start, start + size), self.advantages[start : start + size]
            signs = None if self.zvp_signs is None else self.zvp_signs[start : start + size]
            out.append(make_train_micro_batches(part, adv, max_tokens_per_microbatch, count, zvp_signs=signs))
            start += size
        return out


@dataclass(frozen=True)
class PreparedBatch:
    """A rank batch after the π_old pass (see the module docstring)."""

    mini_batches: tuple[tuple[TrainMicroBatch, ...], ...]
    """Per mini-batch, its micro-batches with the π_old pass's results attached."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The π_old pass's ``old/*`` metrics."""

    @property
    def micro_batches(self) -> list[TrainMicroBatch]:
        return [mb for mini in self.mini_batches for mb in mini]


def regroup(
    micro_batches: Sequence[TrainMicroBatch], sizes: Sequence[int]
) -> tuple[tuple[TrainMicroBatch, ...], ...]:
    """Flat micro-batches back into mini-batches of ``sizes`` micro-batches each."""
    out, start = [], 0
    for size in sizes:
        out.append(tuple(micro_batches[start : start + size]))
        start += size
    return tuple(out)
