"""What the trainer consumes: a packed `moe_rl.data.packing.MicroBatch` plus the per-token
inputs the driver adds (advantages) and those the trainer fills in itself (old log-probs, the
old policy's entropy, the reference policy's log-probs for the KL penalty, recorded routing for R2).

Alignment: ``T`` packed tokens (``input_ids``, ``position_ids``, ``loss_mask``, routing rows),
``R`` response tokens in packed order (``rollout_logp``, ``advantages``, ``old_logp``, the
sampling-mask rows). ``micro.response_positions[r]`` is where response token ``r`` sits; its
log-prob comes from the logits at ``response_positions[r] - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.data.packing import MicroBatch, pack_microbatches
from moe_rl.data.trajectory import TrajectoryBatch


@dataclass
class TrainMicroBatch:
    """One packed micro-batch with everything the log-prob passes and the loss need."""

    micro: MicroBatch
    advantages: Tensor
    """float32 ``[R]``: advantage of every response token (per-sample advantages broadcast, or
    per-token ones such as RL-ZVP's)."""
    old_logp: Tensor | None = None
    """float32 ``[R]``: π_old log-probs; filled by ``TrainerWorker.compute_old_logp``."""
    old_entropy: Tensor | None = None
    """float32 ``[R]``: full-vocabulary entropy of π_old at each response token (ESPO)."""
    ref_logp: Tensor | None = None
    """float32 ``[R]``: log-probs of the reference policy (the KL penalty's π_ref), filled by
    ``TrainerWorker.compute_old_logp`` under the same routing and kept sets as ``old_logp``."""
    recorded_routing: Tensor | None = None
    """int64 ``[T, local MoE layers, k]``: the trainer's own routing in the old-logp pass (R2)."""
    old_weights_version: int | None = None
    """Optimizer steps the trainer had taken when it computed ``old_logp``."""
    old_routing_metrics: dict | None = None
    """Routing agreement of the old-logp pass (trainer-natural vs replayed routing)."""
    zvp_sign: Tensor | None = None
    """int8 ``[S]``: RL-ZVP sign of each sample of this micro-batch (+1 all-correct zero-variance
    group, −1 all-wrong, 0 other); the worker shapes ``advantages`` with it once π_old's entropy is
    known (`moe_rl.algo.advantages.zvp_shape`)."""

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

    def to_(self, device: torch.device | str) -> TrainMicroBatch:
        """Move every tensor of this micro-batch to ``device``, in place (the worker's boundary:
        trajectories arrive as CPU tensors and are moved once); returns ``self``."""
        device = torch.device(device)
        self.micro = self.micro.to(device)
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None and value.device != device:
                setattr(self, name, value.to(device))
        return self

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


_TENSOR_FIELDS = ("advantages", "old_logp", "old_entropy", "ref_logp", "recorded_routing", "zvp_sign")


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
