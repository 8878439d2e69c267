"""`TrainerWorker`: the Megatron-core side of an RL step.

One worker per trainer process. It owns the model (``GPTModel`` in Megatron's
``DistributedDataParallel``), the optimizer and learning-rate schedule (`optim`), the routing
replay adapter (`replay`), with a KL penalty the frozen reference policy (`reference`, the
starting weights: `moe_rl.trainer.reference`), and binds the recipe's objective, corrections and
KL loss through `moe_rl.algo.registry` (the one place config meets the loss math).

A step reads as the algorithm:

* `compute_old_logp`: π_old on every micro-batch (no grad; replaying the engine's routing under
  R3, recording the trainer's under R2; over the kept sets under KSM; full-vocabulary entropy
  for ESPO), plus training–inference mismatch diagnostics; then π_ref with a KL penalty (same
  routing, R2 replaying what the π_old pass recorded, same kept sets).
* `train_step`: for one mini-batch, per micro-batch the ``logp`` pass (same routing and mask
  rules), corrections, objective and KL penalty → ``loss_sum``; backward; gradients summed over
  micro-batches and data-parallel ranks and divided by the global denominator
  (``finalize_model_grads(num_tokens=...)``: the local count is all-reduced over DP×CP);
  clipping and the optimizer step (optionally with the VCPO learning-rate scale).

Denominator: the aggregation's count over the mini-batch's response tokens (token-mean) or
responses (sequence means), known before any forward. Correction masks (IcePop, rejection,
OPSM) zero a token's loss without removing it from the denominator — verl's choice for IcePop,
applied to all of them so the denominator never depends on the current policy.

Device: the worker owns one device, the process's (`moe_rl.device`): the model lives there,
micro-batches arrive as CPU tensors and are moved there once (`TrainMicroBatch.to_`) when a pass
receives them, every tensor a pass creates is created there, and what goes back (metrics) is
read to the CPU once per call.

Pipeline parallelism: with PP = 1 the micro-batch loop here is the no-pipelining schedule; with
PP > 1 both passes run through Megatron's 1F1B schedule (`moe_rl.trainer.pipeline`), and every
rank of a pipeline group returns the same metrics. Virtual pipeline stages are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.algo import registry
from moe_rl.algo.advantages import zvp_shape
from moe_rl.algo.aggregate import local_denominator
from moe_rl.algo.diagnostics import mismatch_metrics, routing_agreement
from moe_rl.algo.modes import Objective, PolicyMode
from moe_rl.config.derived import max_sampled_tokens
from moe_rl.config.modes import ReplayMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.data.packing import RankShare, plan_shards
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.device import check_process_device
from moe_rl.megatron.hf_weights import iter_hf_weights, load_hf_checkpoint
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.parallel import init_parallel
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.trainer import pipeline
from moe_rl.trainer.batch import TrainMicroBatch, make_train_micro_batches
from moe_rl.trainer.logprobs import (
    LogprobOutput,
    PassOptions,
    logprob_pass,
    old_logprobs,
    response_entropy,
    response_logprobs,
    routing_mode,
)
from moe_rl.trainer.optim import build_optimizer, build_scheduler
from moe_rl.trainer.reference import ReferencePolicy, saved_with_reference
from moe_rl.trainer.rules import check_trainer

log = logging.getLogger(__name__)


def _objective_params(config: RecipeConfig) -> dict:
    algo = config.algo
    names = {k for spec in registry.OBJECTIVE_PARAMS.values() for k in spec}
    params = {k: getattr(algo, k) for k in names if hasattr(algo, k)}
    if params.get("dual_clip_c") is not None and params["dual_clip_c"] <= 1:
        params["dual_clip_c"] = None  # the recipe's "<= 1 disables"
    return params


def recipe_objective(config: RecipeConfig):
    """The loss function the trainer trains ``config`` with: its objective, hyper-parameters and
    aggregation bound. DGO's loss −w_i·log π(y_i|x) is REINFORCE with A_i = w_i: the driver computes
    the weights over the whole batch (a prompt's N samples may span micro-batches) and passes them
    as advantages."""
    objective = Objective.REINFORCE if config.algo.objective == Objective.DGO else config.algo.objective
    return registry.bind_objective(
        objective, _objective_params(config), aggregation=config.algo.aggregation,
        norm_len=max_sampled_tokens(config),
    )  # fmt: skip


def _correction_params(config: RecipeConfig) -> dict:
    corrections = dataclasses.asdict(config.algo.corrections)
    corrections.pop("keep_sampling_mask")
    return {**corrections, "mode": config.algo.policy_mode}


class _Timer:
    """Accumulates wall time per named phase (for the step-time breakdown)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class TrainerWorker:
    """Model, optimizer, schedule and the RL passes of one trainer process."""

    def __init__(self, config: RecipeConfig, total_steps: int | None = None, diagnostics: bool = True):
        """``total_steps``: optimizer steps of the run (for the LR schedule; default
        ``run.steps * trainer.num_mini_batches``). ``diagnostics``: mismatch metrics in the
        old-logp pass and routing agreement under replay (one extra router GEMM per MoE layer)."""
        check_trainer(config)
        self.diagnostics = diagnostics
        self.config = config
        self.info = init_parallel(config.parallel)
        self.device = check_process_device(config.run.device)
        self.model = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)
        if config.model.hf_path:
            load_hf_checkpoint(self.model, config.model.hf_path)
        kl = config.algo.kl
        self.reference = ReferencePolicy.of_policy(self.model, config, self.device) if kl.coef > 0 else None
        self.ddp = self._wrap_ddp(self.model)
        trainer = config.trainer
        self.optimizer = build_optimizer([self.ddp], trainer, config.parallel.use_distributed_optimizer)
        steps = total_steps or config.run.steps * trainer.num_mini_batches
        self.scheduler = build_scheduler(self.optimizer, trainer, steps)
        self.replay = RoutingReplay(self.model) if config.algo.routing_replay != ReplayMode.OFF else None
        self.objective = recipe_objective(config)
        self.corrections = registry.bind_corrections(_correction_params(config))
        self.kl_loss = (
            registry.bind_kl_loss(kl.estimator, kl.coef, config.algo.aggregation, max_sampled_tokens(config))
            if kl.coef > 0
            else None
        )
        self.options = PassOptions(
            temperature=config.rollout.temperature,
            chunk_size=trainer.logprob_chunk_size,
            keep_sampling_mask=config.algo.corrections.keep_sampling_mask,
        )
        self.step = 0
        self.mini_batches: list[list[TrainMicroBatch]] = []
        self.timer = _Timer()
        self.pipelined = config.parallel.pipeline_model_parallel_size > 1

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.parallel.use_distributed_optimizer,
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    # ------------------------------------------------------------------ routing
    def _trace_for(self, mb: TrainMicroBatch) -> tuple[Tensor | None, bool]:
        """The routing to replay for ``mb`` and whether it is this stage's layers only."""
        mode = self.config.algo.routing_replay
        if mode == ReplayMode.R3:
            if mb.micro.routed_experts is None:
                raise ValueError(
                    f"algo.routing_replay=r3 but samples {mb.micro.sample_indices.tolist()} carry no "
                    "routed_experts; the rollout engine must return routing (rollout.return_routing)"
                )
            return mb.micro.routed_experts, False
        if mode == ReplayMode.R2 and mb.recorded_routing is not None:
            return mb.recorded_routing, True
        return None, False

    def _agreement(self, natural: Tensor | None, trace: Tensor | None, local: bool, mb) -> dict[str, Tensor]:
        if natural is None or trace is None or self.replay is None:
            return {}
        replayed = trace.long() if local else self.replay.local_layers(trace.long())
        valid = mb.micro.routing_valid
        return routing_agreement(natural, replayed[: natural.shape[0]], valid)

    # ------------------------------------------------------------------ π_old
    def compute_old_logp(self, micro_batches: Sequence[TrainMicroBatch]) -> dict[str, float]:
        """Fill ``old_logp`` (and ``old_entropy`` for ESPO, ``recorded_routing`` for R2, ``ref_logp``
        with a KL penalty) of each micro-batch in place; return mismatch and routing diagnostics
        (means over micro-batches)."""
        self._to_device(micro_batches)
        self.ddp.eval()
        options = dataclasses.replace(self.options, entropy=self.config.trainer.compute_entropy)
        record = self.config.algo.routing_replay == ReplayMode.R2
        if self.pipelined:
            found = self._pipelined_old_logp(micro_batches, options, record)
            self._reference_logp(micro_batches, options)
            return found
        metrics: list[dict[str, Tensor]] = []
        for mb in micro_batches:
            trace, local = self._trace_for(mb) if not record else (None, False)
            natural = trace is not None and self.diagnostics
            with self.timer.section("old_logp"):
                out = old_logprobs(
                    self.model, mb.micro, options, self.replay, trace, record, natural,
                    mb.sample_of_token, self._pad_length(mb),
                )  # fmt: skip
            mb.old_logp, mb.old_entropy = out.logp.detach(), out.entropy
            shaped = self._shape_zero_variance(mb)
            mb.old_weights_version = self.step
            if record:
                mb.recorded_routing = out.recorded_routing
            if self.diagnostics:
                with self.timer.section("diagnostics"):
                    metrics.append({**self._old_metrics(mb, out, trace, local), **shaped})
        self._reference_logp(micro_batches, options)
        return self._reduce_metrics(metrics, prefix="old/")

    def _shape_zero_variance(self, mb: TrainMicroBatch) -> dict[str, Tensor]:
        """RL-ZVP: the advantages of tokens in zero-variance groups from π_old's entropy (the
        driver marked their samples, `TrainMicroBatch.zvp_sign`); the share of tokens shaped."""
        if mb.zvp_sign is None:
            return {}
        if mb.old_entropy is None:
            raise ValueError("zero-variance shaping needs π_old's entropy: set trainer.compute_entropy=true")
        mb.advantages = zvp_shape(
            mb.advantages, mb.old_entropy, torch.ones_like(mb.advantages, dtype=torch.bool), mb.seq_ids,
            num_seqs=mb.num_samples, signs=mb.zvp_sign, alpha=self.config.algo.zero_variance_alpha,
        )  # fmt: skip
        return {"zvp_token_share": (mb.zvp_sign[mb.seq_ids] != 0).float().mean()}

    def _old_metrics(self, mb: TrainMicroBatch, out: LogprobOutput, trace, local) -> dict[str, Tensor]:
        mask = torch.ones_like(mb.old_logp, dtype=torch.bool)
        found = mismatch_metrics(
            mb.old_logp, mb.micro.rollout_logp, mask, mb.seq_ids, num_seqs=mb.num_samples
        )
        mb.old_routing_metrics = self._agreement(out.natural_routing, trace, local, mb)
        found.update(mb.old_routing_metrics)
        return found

    def _reference_logp(self, micro_batches: Sequence[TrainMicroBatch], options: PassOptions) -> None:
        """π_ref's log-probs (``ref_logp``) of every micro-batch, with the routing and kept sets of
        the policy's pass just run: R3 replays the engine's routing, R2 what the policy recorded."""
        if self.reference is None:
            return
        options = dataclasses.replace(options, entropy=False)
        with self.timer.section("ref_logp"), self.reference.resident():
            if self.pipelined:
                self.reference.pipelined_logp(micro_batches, options, self._trace_for, self._pad_length)
                return
            for mb in micro_batches:
                trace, local = self._trace_for(mb)
                mb.ref_logp = self.reference.logp(mb, options, trace, local, self._pad_length(mb))

    # ------------------------------------------------------------------ update
    def _to_device(self, micro_batches: Sequence[TrainMicroBatch]) -> None:
        """The boundary: move each micro-batch to this worker's device (once; a no-op after)."""
        for mb in micro_batches:
            mb.to_(self.device)

    def _denominator(self, mb: TrainMicroBatch) -> Tensor:
        mask = torch.ones(mb.micro.response_positions.numel(), dtype=torch.bool, device=self.device)
        mode = self.config.algo.aggregation
        if mode not in registry.AGGREGATIONS:  # ESPO's seq_mean_group_mean: a mean over responses
            mode = "seq_mean_token_mean"  # any sequence mode: the count of responses
        return local_denominator(mask, mb.seq_ids, num_seqs=mb.num_samples, mode=mode)

    def _micro_loss(self, mb: TrainMicroBatch, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Corrections, objective and KL penalty on one micro-batch: ``(loss_sum, metrics)``."""
        seq_ids, num_seqs = mb.seq_ids, mb.num_samples
        mask = torch.ones_like(logp, dtype=torch.bool)
        rollout = mb.micro.rollout_logp.to(logp.device)
        old = self.corrections.old_logp(mb.old_logp, rollout)
        with self.timer.section("corrections"):
            corr = self.corrections(
                logp=logp, old_logp=old, rollout_logp=rollout, advantages=mb.advantages,
                loss_mask=mask, seq_ids=seq_ids, num_seqs=num_seqs,
            )  # fmt: skip
        with self.timer.section("objective"):
            out = self.objective(
                logp=logp, old_logp=old, advantages=mb.advantages, loss_mask=corr.mask, seq_ids=seq_ids,
                num_seqs=num_seqs, weights=corr.weights, entropy=mb.old_entropy,
                vocab_size=self.config.model.vocab_size,
            )  # fmt: skip
        loss_sum, metrics = out.loss_sum, {**corr.metrics, **out.metrics}
        if self.kl_loss is not None:
            # The tokens the policy term counts (a correction's drop leaves both terms) and the same
            # denominator; k3_is weights by π_θ/π_old, π_old being the rollout policy in bypass mode.
            with self.timer.section("kl"):
                kl = self.kl_loss(
                    logp=logp, ref_logp=mb.ref_logp, old_logp=old, loss_mask=corr.mask, seq_ids=seq_ids,
                    num_seqs=num_seqs,
                )  # fmt: skip
            loss_sum = loss_sum + kl.loss_sum
            metrics.update(kl.metrics)
        return loss_sum, metrics

    def _pad_length(self, mb: TrainMicroBatch) -> int | None:
        """Token count every expert-parallel rank pads this micro-batch to (None: no padding).

        Megatron's allgather dispatcher gathers equal-sized blocks over the EP group, so the
        ranks of one EP group agree on the largest micro-batch (one small all-reduce)."""
        from megatron.core import parallel_state as ps

        if ps.get_expert_model_parallel_world_size() == 1:
            return None
        length = torch.full((1,), mb.micro.num_tokens, dtype=torch.int64, device=self.device)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
        return int(length)

    def _known_agreement(self, mb: TrainMicroBatch) -> dict | None:
        """The old-logp pass's routing agreement when the weights have not moved since: the
        update pass would replay the same ids through the same routers (no need to recompute)."""
        if mb.old_weights_version == self.step and mb.old_routing_metrics:
            return mb.old_routing_metrics
        return None

    def _micro_step(self, mb: TrainMicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward, loss and backward of one micro-batch under the recipe's routing."""
        trace, local = self._trace_for(mb)
        pad_to = self._pad_length(mb)
        known = self._known_agreement(mb)
        natural = trace is not None and self.diagnostics and known is None
        with routing_mode(
            self.replay, trace, pad_to or mb.micro.num_tokens, natural=natural,
            sample_of_token=mb.sample_of_token, local=local,
        ) as routing:  # fmt: skip
            # the old-logp pass has checked this micro-batch's sampling mask already
            options = dataclasses.replace(self.options, validate_mask=mb.old_logp is None)
            with self.timer.section("forward"):
                out = logprob_pass(self.ddp, mb.micro, options, pad_to)
            loss_sum, metrics = self._micro_loss(mb, out.logp)
            if trace is not None:
                self.replay.forward_done()
            with self.timer.section("backward"):
                loss_sum.backward()
        captured = routing.get("natural")
        if captured is not None:
            known = self._agreement(captured[: mb.micro.num_tokens], trace, local, mb)
        metrics.update(known or {})
        return loss_sum.detach(), metrics

    def accumulate_gradients(
        self, mini_batch: Sequence[TrainMicroBatch]
    ) -> tuple[Tensor, Tensor, list[dict]]:
        """Forward and backward over the mini-batch; gradients summed over micro-batches and DP
        ranks and divided by the global denominator, left in ``param.main_grad``.

        Returns ``(local loss_sum, global denominator, per-micro-batch metrics)``.
        """
        from megatron.core.distributed import finalize_model_grads

        holds_logits = not self.pipelined or pipeline.is_last_stage()  # π_old lives with the logits
        if (
            holds_logits
            and any(mb.old_logp is None for mb in mini_batch)
            and self.config.algo.policy_mode != PolicyMode.BYPASS
        ):
            raise ValueError("train_step needs old_logp on every micro-batch: call compute_old_logp first")
        if holds_logits and self.reference is not None and any(mb.ref_logp is None for mb in mini_batch):
            raise ValueError(
                f"algo.kl.coef={self.config.algo.kl.coef}: train_step needs ref_logp on every micro-batch; "
                "call compute_old_logp first"
            )
        self._to_device(mini_batch)
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        denom = torch.stack([self._denominator(mb) for mb in mini_batch]).sum()
        if self.pipelined:
            loss_sum, metrics = self._pipelined_update(mini_batch)
        else:
            loss_sum = torch.zeros((), device=self.device)
            metrics = []
            for mb in mini_batch:
                micro_loss, micro_metrics = self._micro_step(mb)
                loss_sum += micro_loss.float()
                metrics.append(micro_metrics)
        with self.timer.section("grad_sync"):
            finalize_model_grads([self.ddp], num_tokens=denom)  # all-reduces denom over DP x CP
        return loss_sum, denom, metrics

    def train_step(self, mini_batch: Sequence[TrainMicroBatch]) -> dict[str, float]:
        """One optimizer step on a mini-batch of micro-batches (this rank's share); metrics."""
        loss_sum, global_denom, metrics = self.accumulate_gradients(mini_batch)
        lr_scale = self._vcpo_scale(mini_batch)
        with self.timer.section("optimizer"):
            ok, grad_norm = self._optimizer_step(lr_scale)
        result = self._reduce_metrics(metrics, prefix="train/")
        result.update(self._step_metrics(loss_sum, global_denom, ok, grad_norm, lr_scale))
        self.step += 1
        if self.pipelined:
            result = pipeline.merge_stage_metrics(result, self._num_moe_layers)
        return result

    # ------------------------------------------------------------------ a rollout batch
    def old_logp_of(
        self, batch: TrajectoryBatch, advantages: Tensor, share: RankShare | None = None,
        zvp_signs: Tensor | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Take this rank's share of a rollout batch (a CPU trajectory, its samples mini-batch after
        mini-batch, `moe_rl.data.packing.ShardPlan`) with its per-sample advantages: pack each
        mini-batch into its micro-batches, keep them, and run the π_old pass over all of them.
        Without ``share`` the batch is the whole rollout batch of a one-rank trainer. ``zvp_signs``
        (per sample, RL-ZVP) are the driver's zero-variance signs of these samples."""
        t = self.config.trainer
        if share is None:
            share = plan_shards(batch, 1, t.max_tokens_per_microbatch, t.num_mini_batches).rank(0)
        if sum(share.samples) != batch.num_samples or advantages.numel() != batch.num_samples:
            raise ValueError(
                f"a rank's share lists {sum(share.samples)} samples, its batch has {batch.num_samples} and "
                f"{advantages.numel()} advantages"
            )
        if self.config.algo.zero_variance_shaping != (zvp_signs is not None):
            raise ValueError(
                f"algo.zero_variance_shaping={self.config.algo.zero_variance_shaping} but zero-variance signs "
                f"were {'not ' if zvp_signs is None else ''}given"
            )
        self.mini_batches, start = [], 0
        for size, count in zip(share.samples, share.micro_batches):
            part, adv = batch.slice(start, start + size), advantages[start : start + size]
            signs = None if zvp_signs is None else zvp_signs[start : start + size]
            self.mini_batches.append(
                make_train_micro_batches(part, adv, t.max_tokens_per_microbatch, count, zvp_signs=signs)
            )
            start += size
        return self.compute_old_logp([mb for mini in self.mini_batches for mb in mini])

    def train_on_batch(self) -> dict[str, float]:
        """One optimizer step per kept mini-batch; metrics averaged over the steps."""
        per_step = [self.train_step(mini) for mini in self.mini_batches]
        self.mini_batches = []
        keys = {k for m in per_step for k in m}
        return {k: sum(m[k] for m in per_step if k in m) / sum(k in m for m in per_step) for k in keys}

    def _optimizer_step(self, lr_scale: float) -> tuple[bool, float | None]:
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] *= lr_scale
        ok, grad_norm, _ = self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler.step(1)
        return ok, grad_norm

    def _vcpo_scale(self, mini_batch: Sequence[TrainMicroBatch]) -> float:
        """VCPO: ``sqrt(ESS / ESS_ref)`` of the rollout-vs-old token ratios over the mini-batch
        (all DP ranks), with ``ESS_ref = 1`` (the on-policy value of the normalized ESS)."""
        if not self.config.trainer.vcpo_lr_scaling:
            return 1.0
        if self.pipelined:  # π_old lives on the last stage
            scale = self._vcpo_local(mini_batch) if pipeline.is_last_stage() else 0.0
            return pipeline.broadcast_from_last_stage(scale)
        return self._vcpo_local(mini_batch)

    def _vcpo_local(self, mini_batch: Sequence[TrainMicroBatch]) -> float:
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for mb in mini_batch:
            log_rho = (mb.old_logp - mb.micro.rollout_logp).double().clamp(-20, 20)
            w = log_rho.exp()
            sums[0] += w.sum()
            sums[1] += (w * w).sum()
            sums[2] += w.numel()
        self._all_reduce(sums)
        ess = sums[0] ** 2 / (sums[2] * sums[1]).clamp_min(1e-300)
        return float(torch.sqrt(ess.clamp(max=1.0)))

    # ------------------------------------------------------------------ pipeline (PP > 1)
    @property
    def _num_moe_layers(self) -> int:
        return len(self.replay.routers) if self.replay is not None else 0

    def _pipelined_old_logp(self, micro_batches, options: PassOptions, record: bool) -> dict[str, float]:
        """`compute_old_logp` through the 1F1B schedule (forward only)."""
        found: dict[int, dict[str, Tensor]] = {id(mb): {} for mb in micro_batches}
        routed = self.replay is not None and bool(self.replay.routers)
        recordings: dict[int, object] = {}

        def before(mb: TrainMicroBatch) -> None:
            trace, local = self._trace_for(mb) if not record else (None, False)
            if routed and record:
                ctx = self.replay.record()
                recordings[id(mb)] = (ctx, ctx.__enter__())
            elif routed and trace is not None:
                self.replay.set_replay(
                    trace, self._pad_length(mb) or mb.micro.num_tokens, mb.sample_of_token, local
                )

        def after(mb: TrainMicroBatch) -> None:
            trace, local = self._trace_for(mb) if not record else (None, False)
            if id(mb) in recordings:
                ctx, recording = recordings.pop(id(mb))
                ctx.__exit__(None, None, None)
                mb.recorded_routing = recording.topk_idx_TLK[: mb.micro.num_tokens]
            elif routed and trace is not None:
                latest = natural.latest() if natural is not None else None
                if latest is not None:
                    mb.old_routing_metrics = self._agreement(latest[: mb.micro.num_tokens], trace, local, mb)
                    found[id(mb)].update(mb.old_routing_metrics)
                self.replay.clear()

        def on_logits(mb: TrainMicroBatch, logits: Tensor) -> Tensor:
            with torch.no_grad():
                mb.old_logp = response_logprobs(
                    logits, mb.micro, options.temperature, options.chunk_size, options.keep_sampling_mask
                ).detach()
                if options.entropy:
                    mb.old_entropy = response_entropy(
                        logits, mb.micro, options.temperature, options.chunk_size
                    )
                found[id(mb)].update(self._shape_zero_variance(mb))
            mb.old_weights_version = self.step
            if self.diagnostics:
                mask = torch.ones_like(mb.old_logp, dtype=torch.bool)
                found[id(mb)].update(
                    mismatch_metrics(
                        mb.old_logp, mb.micro.rollout_logp, mask, mb.seq_ids, num_seqs=mb.num_samples
                    )
                )
            return logits.new_zeros(())

        natural_ctx = self.replay.natural_routing() if routed and self.diagnostics else None
        natural = natural_ctx.__enter__() if natural_ctx is not None else None
        try:
            with self.timer.section("old_logp"), torch.no_grad():
                pipeline.run_schedule(
                    self.ddp, micro_batches, True, before, after, on_logits, self._pad_length
                )
        finally:
            if natural_ctx is not None:
                natural_ctx.__exit__(None, None, None)
        result = self._reduce_metrics(list(found.values()), prefix="old/")
        return pipeline.merge_stage_metrics(result, self._num_moe_layers)

    def _pipelined_update(self, mini_batch) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """Forward and backward of a mini-batch through the 1F1B schedule: ``(loss_sum, metrics)``."""
        found: dict[int, dict[str, Tensor]] = {id(mb): {} for mb in mini_batch}
        routed = self.replay is not None and bool(self.replay.routers)
        loss_sum = torch.zeros((), device=self.device)

        def before(mb: TrainMicroBatch) -> None:
            trace, local = self._trace_for(mb)
            if routed and trace is not None:
                self.replay.set_replay(
                    trace, self._pad_length(mb) or mb.micro.num_tokens, mb.sample_of_token, local
                )

        def after(mb: TrainMicroBatch) -> None:
            trace, local = self._trace_for(mb)
            if not routed or trace is None:
                return
            self.replay.forward_done()  # a recompute in this micro-batch's backward replays its ids
            known = self._known_agreement(mb)
            latest = natural.latest() if natural is not None and known is None else None
            if latest is not None:
                known = self._agreement(latest[: mb.micro.num_tokens], trace, local, mb)
            found[id(mb)].update(known or {})

        def on_logits(mb: TrainMicroBatch, logits: Tensor) -> Tensor:
            nonlocal loss_sum
            options = dataclasses.replace(self.options, validate_mask=mb.old_logp is None)
            logp = response_logprobs(
                logits, mb.micro, options.temperature, options.chunk_size, options.keep_sampling_mask,
                options.validate_mask,
            )  # fmt: skip
            micro_loss, metrics = self._micro_loss(mb, logp)
            found[id(mb)].update(metrics)
            loss_sum = loss_sum + micro_loss.detach().float()
            return micro_loss

        natural_ctx = self.replay.natural_routing() if routed and self.diagnostics else None
        natural = natural_ctx.__enter__() if natural_ctx is not None else None
        try:
            with self.timer.section("forward_backward"):
                pipeline.run_schedule(self.ddp, mini_batch, False, before, after, on_logits, self._pad_length)
        finally:
            if natural_ctx is not None:
                natural_ctx.__exit__(None, None, None)
            if self.replay is not None:
                self.replay.clear()
        return loss_sum, list(found.values())

    # ------------------------------------------------------------------ metrics
    def _all_reduce(self, tensor: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        from megatron.core import parallel_state as ps

        if dist.is_initialized() and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
            dist.all_reduce(tensor, op=op, group=ps.get_data_parallel_group(with_context_parallel=True))
        return tensor

    def _reduce_metrics(self, metrics: list[dict[str, Tensor]], prefix: str) -> dict[str, float]:
        """Mean over micro-batches, then over data-parallel ranks; read to the CPU once."""
        names = sorted({k for m in metrics for k in m})
        if not names:
            return {}
        table = torch.zeros(len(names), 2, dtype=torch.float64, device=self.device)
        for m in metrics:
            for i, name in enumerate(names):
                if name in m:
                    table[i, 0] += m[name]
                    table[i, 1] += 1
        self._all_reduce(table)
        means = (table[:, 0] / table[:, 1].clamp_min(1)).tolist()
        return {prefix + n: mean for n, mean in zip(names, means)}

    def _step_metrics(self, loss_sum: Tensor, denom: Tensor, ok: bool, grad_norm, lr_scale: float) -> dict:
        total = self._all_reduce(loss_sum.double().clone())
        loss, denom_value = torch.stack([total / denom.double().clamp_min(1e-12), denom.double()]).tolist()
        return {
            "train/loss": loss,
            "train/denominator": denom_value,
            "train/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
            "train/update_ok": float(ok),
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/lr_scale": lr_scale,
            "train/step": float(self.step + 1),
        }

    # ------------------------------------------------------------------ checkpoints
    def _rng_state(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            state["cuda"] = torch.cuda.get_rng_state()
            state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
        return state

    def _set_rng_state(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            torch.cuda.set_rng_state(state["cuda"])
            get_cuda_rng_tracker().set_states(state["cuda_tracker"])

    def _sharded_state(self, is_loading: bool, reference: bool = True) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        model_sd = self.model.sharded_state_dict()
        rank, world = dist.get_rank(), dist.get_world_size()
        state = {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": ShardedObject("rng_state", self._rng_state(), (world,), (rank,), replica_id=0),
        }
        if reference and self.reference is not None:
            state["reference"] = self.reference.sharded_state_dict()
        return state

    def _reference_resident(self) -> AbstractContextManager:
        """The reference's weights on the device for a checkpoint's save or load (when offloaded)."""
        return self.reference.resident() if self.reference is not None else nullcontext()

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save model, optimizer, schedule, RNG, step and, with a KL penalty, the reference policy
        with Megatron ``dist_checkpointing``."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with self._reference_resident():
            dist_checkpointing.save(self._sharded_state(is_loading=False), str(directory))
        log.info("saved checkpoint of step %d to %s", self.step, directory)
        return directory

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore everything `save_checkpoint` wrote; returns the step. The reference policy is
        the saved one, the original run's starting weights; a checkpoint saved without a KL penalty
        holds none, and the reference stays the starting weights this worker built."""
        from megatron.core import dist_checkpointing

        with_reference = self.reference is not None and saved_with_reference(directory)
        if self.reference is not None and not with_reference:
            log.warning(
                "checkpoint %s holds no reference policy (saved with algo.kl.coef=0): the reference is "
                "the starting weights of this run's model.hf_path or run.seed", directory,
            )  # fmt: skip
        with self._reference_resident():
            state = dist_checkpointing.load(self._sharded_state(True, with_reference), str(directory))
            if with_reference:
                self.reference.load_sharded(state["reference"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._set_rng_state(state["rng"])
        self.step = int(state["step"])
        log.info("loaded checkpoint of step %d from %s", self.step, directory)
        return self.step

    # ------------------------------------------------------------------ weights
    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Stream this rank's weights with HF names (`hf_weights.iter_hf_weights`)."""
        return iter_hf_weights(self.model)

    def step_time_breakdown(self) -> dict[str, float]:
        """Seconds spent per phase since the worker started (forward, backward, corrections, …)."""
        return dict(self.timer.seconds)
