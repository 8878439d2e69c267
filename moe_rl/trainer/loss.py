"""The recipe's loss as the trainer computes it, resolved once from the config.

`TrainerLoss.of` binds the objective (with `moe_rl.algo.registry.bind_recipe_objective`: DGO
trains as REINFORCE over its weights, a dual-clip floor <= 1 is off), the corrections, the KL
penalty (in the loss, or with ``algo.kl.in_reward`` in a token-level estimator's rewards), a
token-level estimator's returns and the aggregation whose count divides the loss (an objective's own aggregation, ESPO's
groups, counts responses), so no pass decides any of it again. It hands the registry the recipe's
typed modes and every value (the schema holds the defaults); the registry checks each function
takes what it binds, so a mismatch stops the run at start. `micro_loss` is one micro-batch's
loss sum: corrections, objective and KL penalty on its response tokens.

Denominator: the aggregation's count over the mini-batch's response tokens (token-mean) or
responses (sequence means), known before any forward. Correction masks (IcePop, rejection, OPSM)
zero a token's loss without removing it from the denominator — verl's choice for IcePop, applied
to all of them so the denominator never depends on the current policy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo import registry
from moe_rl.algo.aggregate import local_denominator
from moe_rl.algo.modes import Aggregation
from moe_rl.config.derived import max_sampled_tokens
from moe_rl.config.schema import RecipeConfig
from moe_rl.trainer.batch import TrainMicroBatch


@dataclass(frozen=True)
class TrainerLoss:
    """The bound loss of a recipe (see the module docstring)."""

    objective: registry.Bound
    corrections: registry.CorrectionStack
    kl: registry.Bound | None
    """The KL penalty as a loss (``algo.kl.coef > 0``), else None."""
    denominator: Aggregation
    """The aggregation whose count divides the loss (`registry.denominator_aggregation`)."""
    vocab_size: int
    returns: registry.Bound | None = None
    """A token-level estimator's part at the π_old pass (`registry.bind_token_advantage`: GAE,
    REINFORCE++), else None (the driver's per-response advantages are the loss's)."""

    @classmethod
    def of(cls, config: RecipeConfig) -> TrainerLoss:
        algo, kl = config.algo, config.algo.kl
        norm_len = max_sampled_tokens(config)
        corrections = dataclasses.asdict(algo.corrections)
        del corrections["keep_sampling_mask"]  # applies to the π passes' log-probs, not to the loss
        return cls(
            objective=registry.bind_recipe_objective(
                algo.objective, dataclasses.asdict(algo), algo.aggregation, norm_len
            ),
            corrections=registry.bind_corrections(corrections, algo.policy_mode),
            kl=registry.bind_kl_loss(kl.estimator, kl.coef, algo.aggregation, norm_len)
            if kl.coef > 0 and not kl.in_reward
            else None,
            denominator=registry.denominator_aggregation(algo.aggregation),
            vocab_size=config.model.vocab_size,
            returns=registry.bind_token_advantage(
                algo.advantage, dataclasses.asdict(algo.gae), kl.coef, kl.estimator, kl.in_reward
            ),
        )

    def local_denominator(self, mb: TrainMicroBatch, device: torch.device) -> Tensor:
        """This micro-batch's share of the divisor: its response tokens or responses."""
        mask = torch.ones(mb.micro.response_positions.numel(), dtype=torch.bool, device=device)
        return local_denominator(mask, mb.seq_ids, num_seqs=mb.num_samples, mode=self.denominator)

    def micro_loss(self, mb: TrainMicroBatch, logp: Tensor, timer) -> tuple[Tensor, dict[str, Tensor]]:
        """Corrections, objective and KL penalty on one micro-batch: ``(loss_sum, metrics)``."""
        seq_ids, num_seqs = mb.seq_ids, mb.num_samples
        mask = torch.ones_like(logp, dtype=torch.bool)
        rollout = mb.micro.rollout_logp.to(logp.device)
        old = self.corrections.old_logp(mb.old_logp, rollout)
        with timer.section("corrections"):
            corr = self.corrections(
                logp=logp, old_logp=old, rollout_logp=rollout, advantages=mb.advantages,
                loss_mask=mask, seq_ids=seq_ids, num_seqs=num_seqs,
            )  # fmt: skip
        with timer.section("objective"):
            out = self.objective(
                logp=logp, old_logp=old, advantages=mb.advantages, loss_mask=corr.mask, seq_ids=seq_ids,
                num_seqs=num_seqs, weights=corr.weights, entropy=mb.old_entropy, vocab_size=self.vocab_size,
            )  # fmt: skip
        loss_sum, metrics = out.loss_sum, {**corr.metrics, **out.metrics}
        if self.kl is not None:
            # The tokens the policy term counts (a correction's drop leaves both terms) and the same
            # denominator; k3_is weights by π_θ/π_old, π_old being the rollout policy in bypass mode.
            with timer.section("kl"):
                kl = self.kl(
                    logp=logp, ref_logp=mb.ref_logp, old_logp=old, loss_mask=corr.mask, seq_ids=seq_ids,
                    num_seqs=num_seqs,
                )  # fmt: skip
            loss_sum = loss_sum + kl.loss_sum
            metrics.update(kl.metrics)
        return loss_sum, metrics
