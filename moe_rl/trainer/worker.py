"""`TrainerWorker`: the Megatron-core side of an RL step, one per trainer process.

It owns the model (``GPTModel`` in Megatron's ``DistributedDataParallel``), the optimizer and
learning-rate schedule (`optim`), the routing replay adapter (`moe_rl.megatron.replay`), with a KL
penalty the frozen reference policy (`reference`, the starting weights), and the recipe's loss
resolved once (`loss.TrainerLoss`: objective, corrections and KL penalty bound through
`moe_rl.algo.registry`, the one place config meets the loss math). The code is split by concern:
the passes over micro-batches (`passes`), the optimizer step and its reductions (`update`),
checkpoints (`checkpoint`).

A step reads as the algorithm, and nothing passes between its two calls but what they return:

* `old_logp(batch)`: the rank's `TrainerBatch` (its samples with their advantages) packed into
  micro-batches, π_old on every one (no grad; replaying the engine's routing under R3, recording
  the trainer's under R2; over the kept sets under KSM; full-vocabulary entropy for ESPO and
  RL-ZVP), mismatch diagnostics, then π_ref with a KL penalty (same routing, same kept sets):
  a `PreparedBatch`;
* `train(prepared)`: one optimizer step per mini-batch (`train_step`): per micro-batch the
  ``logp`` pass (same routing and mask rules), corrections, objective and KL penalty → a loss sum;
  backward; gradients summed over micro-batches and data-parallel ranks and divided by the global
  denominator; clipping and the optimizer step (optionally with the VCPO learning-rate scale).

Device: the worker owns one device, the process's (`moe_rl.device`): the model lives there,
micro-batches arrive as CPU tensors and are moved there once, when a pass receives them, every
tensor a pass creates is created there, and what goes back (metrics) is read to the CPU once per
call.

Pipeline parallelism: every pass runs through the same callbacks at any pipeline size
(`passes.run_schedule`: a loop over micro-batches with PP = 1, Megatron's 1F1B schedule with
PP > 1), and every rank of a pipeline group returns the same metrics. Virtual pipeline stages are
refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.algo.modes import Advantage, PolicyMode
from moe_rl.config.modes import ReplayMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.device import check_process_device
from moe_rl.megatron.lora import freeze_base
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.parallel import init_parallel
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.offload import GIB, DriverMemory, Offload, resident_bytes
from moe_rl.trainer import checkpoint, passes, pipeline, update
from moe_rl.trainer.batch import PreparedBatch, TrainerBatch, TrainMicroBatch, regroup
from moe_rl.trainer.critic import Critic
from moe_rl.trainer.logprobs import PassOptions
from moe_rl.trainer.loss import TrainerLoss
from moe_rl.trainer.optim import build_optimizer, build_scheduler, optimizer_state_tensors
from moe_rl.trainer.perf import RankPerf, sequence_lengths, synchronize
from moe_rl.trainer.reference import ReferencePolicy
from moe_rl.trainer.returns import distill_advantages, token_returns
from moe_rl.trainer.rules import check_trainer
from moe_rl.trainer.teacher import build_teacher, teacher_source

log = logging.getLogger(__name__)


class TrainerWorker:
    """Model, optimizer, schedule and the RL passes of one trainer process."""

    def __init__(self, config: RecipeConfig, total_steps: int | None = None, diagnostics: bool = True):
        """``total_steps``: optimizer steps of the run (for the LR schedule; default
        ``run.steps * trainer.num_mini_batches``). ``diagnostics``: mismatch metrics in the
        old-logp pass and routing agreement under replay (one extra router GEMM per MoE layer)."""
        check_trainer(config)
        self.config = config
        self.info = init_parallel(config.parallel)
        self.device = check_process_device(config.run.device)
        self.driver = DriverMemory(self.device)  # before anything is allocated: its context
        self.model = build_gpt_model(
            config.model, config.parallel, config.trainer, seed=config.run.seed, lora=config.lora
        )
        checkpoint.load_start_weights(self.model, config)  # e.g. an SFT run's: the optimizer afresh
        if config.lora.rank > 0:  # only the adapters train: the rest gets no gradient buffer, no Adam state
            trainable = freeze_base(self.model, config.lora)
            log.info("LoRA rank %d: %d trainable parameters on this rank", config.lora.rank, trainable)
        kl = config.algo.kl
        self.reference = ReferencePolicy.of_policy(self.model, config, self.device) if kl.coef > 0 else None
        trainer = config.trainer
        steps = total_steps or config.run.steps * trainer.num_mini_batches
        teacher = teacher_source(config) if config.algo.distill.coef > 0 else None
        self.teacher = build_teacher(config, teacher, self.device) if teacher is not None else None
        self.critic = (
            Critic(
                config,
                checkpoint.critic_start(config, self.model),
                self._wrap_ddp,
                steps + config.critic.warmup_steps,
            )
            if config.algo.advantage == Advantage.GAE
            else None
        )
        self.ddp = self._wrap_ddp(self.model)
        self.optimizer = build_optimizer([self.ddp], trainer, config.parallel.use_distributed_optimizer)
        self.scheduler = build_scheduler(self.optimizer, trainer, steps)
        replay = RoutingReplay(self.model) if config.algo.routing_replay != ReplayMode.OFF else None
        self.loss = TrainerLoss.of(config)
        self.pipelined = config.parallel.pipeline_model_parallel_size > 1
        self.passes = passes.PassContext(
            replay=replay,
            routing_replay=config.algo.routing_replay,
            options=PassOptions(
                temperature=config.rollout.temperature,
                chunk_size=trainer.logprob_chunk_size,
                keep_sampling_mask=config.algo.corrections.keep_sampling_mask,
            ),
            diagnostics=diagnostics,
            pipelined=self.pipelined,
            pad_length=self._pad_length,
        )
        self._shape = passes.shape_zero_variance(config.algo.zero_variance_alpha)
        self.step = 0
        self._offload: Offload | None = None  # what `release_memory` moved out
        self._offload_params: Offload | None = None  # the parameters, when it moved them out too
        dtype = next(self.model.parameters()).dtype
        self.perf = RankPerf.of(config, self.device, dtype)
        self.teacher_perf = (
            RankPerf.of(dataclasses.replace(config, model=teacher.model), self.device, dtype)
            if teacher
            else None
        )

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.parallel.use_distributed_optimizer,
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    @property
    def replay(self) -> RoutingReplay | None:
        return self.passes.replay

    @property
    def diagnostics(self) -> bool:
        return self.passes.diagnostics

    @property
    def timer(self) -> passes.Timer:
        return self.passes.timer

    # ------------------------------------------------------------------ a rollout batch
    def old_logp(self, batch: TrainerBatch) -> PreparedBatch:
        """This rank's batch packed mini-batch by mini-batch, with the π_old pass's results (and
        π_ref's with a KL penalty) attached; its metrics are ``PreparedBatch.metrics``."""
        if self.config.algo.zero_variance_shaping != (batch.zvp_signs is not None):
            raise ValueError(
                f"algo.zero_variance_shaping={self.config.algo.zero_variance_shaping} but zero-variance signs "
                f"were {'not ' if batch.zvp_signs is None else ''}given"
            )
        t0 = time.perf_counter()
        packed = batch.mini_batches(self.config.trainer.max_tokens_per_microbatch)
        flat = [mb for mini in packed for mb in mini]
        prepared, metrics = self.compute_old_logp(flat)
        synchronize(self.device)
        lengths = sequence_lengths(mb.micro.cu_seqlens for mb in flat)
        forwards = 1 + (self.reference is not None) + (self.critic is not None)  # π_old, π_ref, V
        metrics["perf/old_logp_tflop"] = self.perf.tflop(lengths, forwards)
        if self.teacher_perf is not None:  # the teacher's forward, of its own size
            metrics["perf/old_logp_tflop"] += self.teacher_perf.tflop(lengths)
        metrics["perf/old_logp_s"] = time.perf_counter() - t0
        return PreparedBatch(regroup(prepared, [len(mini) for mini in packed]), metrics)

    def train(self, prepared: PreparedBatch) -> dict[str, float]:
        """One optimizer step per mini-batch of a prepared batch; metrics averaged over the steps,
        with the rank's model FLOP rate over this batch's π_old (and π_ref) and training passes
        (`RankPerf`)."""
        t0 = time.perf_counter()
        per_step = [self.train_step(mini) for mini in prepared.mini_batches]
        synchronize(self.device)
        seconds = time.perf_counter() - t0 + prepared.metrics.get("perf/old_logp_s", 0.0)
        lengths = sequence_lengths(mb.micro.cu_seqlens for mini in prepared.mini_batches for mb in mini)
        tflop = self.perf.tflop(lengths, training=True) + prepared.metrics.get("perf/old_logp_tflop", 0.0)
        keys = {k for m in per_step for k in m}
        out = {k: sum(m[k] for m in per_step if k in m) / sum(k in m for m in per_step) for k in keys}
        out |= self.perf.metrics(tflop, seconds)
        out["memory/trainer_train_gib"] = self.resident_bytes() / GIB  # what the train phase leaves resident
        if self.device.type == "cuda":  # the most since the step's generation (or the start)
            out["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
        return out | self.driver.readings("trainer", "train")

    # ------------------------------------------------------------------ memory between phases
    def release_memory(self, params: bool = False) -> dict[str, float]:
        """Before a colocated generation: the optimizer's state and the gradient buffers (and the
        parameters, with ``params``) leave device memory (`moe_rl.offload`) until `restore_memory`."""
        if self._offload is not None:
            raise RuntimeError("trainer memory released twice without a restore")
        self._offload = Offload("trainer")
        self._offload.add(self._optimizer_states())
        self._offload.add(self._grad_buffers())
        if self.critic is not None:  # the critic's weights too: no weight sync reads them
            self._offload.add(self.critic.model.parameters())
        if params:  # apart, so that a weight sync can take them back for a while (`weights_resident`)
            held = {h.storage.data_ptr() for h in self._offload.held}
            self._offload_params = Offload("trainer parameters")
            self._offload_params.add(
                p for p in self.model.parameters() if p.untyped_storage().data_ptr() not in held
            )
        freed = self._offload.release()
        if self._offload_params is not None:
            freed += self._offload_params.release()
        weights = resident_bytes(self.model.parameters())
        return {
            "released_bytes": float(freed),
            "resident_bytes": float(self.resident_bytes()),
            "weights_bytes": float(weights),
        } | self.driver.readings("trainer", "generate")

    def restore_memory(self) -> dict[str, float]:
        """After a colocated generation: what `release_memory` moved out is back where it was."""
        if self._offload is None:
            raise RuntimeError("trainer memory restored without a release")
        self._offload.restore()
        if self._offload_params is not None:
            self._offload_params.restore()
        self._offload = self._offload_params = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(
                self.device
            )  # the old log-prob and train passes' peak from here
        return {"resident_bytes": float(self.resident_bytes())}

    @contextlib.contextmanager
    def weights_resident(self) -> Iterator[None]:
        """The parameters in device memory for the span, and released again after it, when
        `release_memory` moved them out: a weight sync during a colocated generation (an engine
        restarted there is brought to the current weights) reads them."""
        params = self._offload_params
        if params is None:
            yield
            return
        params.restore()
        try:
            yield
        finally:
            params.release()

    def resident_bytes(self) -> int:
        """Memory this rank holds on its device: on CUDA what torch has allocated; on CPU the bytes of
        its parameters, gradient buffers and optimizer state as they are now."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        critic = [] if self.critic is None else list(self.critic.model.parameters())
        return resident_bytes(
            [*self.model.parameters(), *critic, *self._grad_buffers(), *self._optimizer_states()]
        )

    def _grad_buffers(self) -> list[Tensor]:
        """Megatron's gradient buffers (dense and expert-parallel; the critic's too): every
        ``main_grad`` views one."""
        critic = [] if self.critic is None else self.critic.grad_buffers()
        return [buffer.grad_data for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers] + critic

    def _optimizer_states(self) -> list[Tensor]:
        """The optimizers' state tensors (the policy's, and the critic's)."""
        critic = [] if self.critic is None else optimizer_state_tensors(self.critic.optimizer)
        return optimizer_state_tensors(self.optimizer) + critic

    # ------------------------------------------------------------------ π_old (and π_ref)
    def compute_old_logp(
        self, micro_batches: Sequence[TrainMicroBatch]
    ) -> tuple[list[TrainMicroBatch], dict[str, float]]:
        """π_old over ``micro_batches`` (moved to this worker's device) and, with a KL penalty, π_ref:
        new micro-batches carrying ``old_logp`` (``old_entropy`` when asked, ``recorded_routing``
        for R2, ``ref_logp``, RL-ZVP's shaped advantages), and the ``old/*`` metrics (means over
        micro-batches)."""
        micro_batches = self._to_device(micro_batches)
        self.ddp.eval()
        with self.timer.section("old_logp"):
            prepared, found = passes.old_pass(
                self.passes,
                self.ddp,
                micro_batches,
                self.step,
                self.config.trainer.compute_entropy,
                self._shape,
            )
        if self.reference is not None:
            with self.timer.section("ref_logp"), self.reference.resident():
                prepared = passes.reference_pass(self.passes, self.reference, prepared)
        returns: dict[str, float] = {}
        if self.loss.returns is not None:
            with self.timer.section("returns"):
                values = self.critic.values(self.passes, prepared) if self.critic is not None else {}
                if not self.pipelined or pipeline.is_last_stage():  # π_old lives with the logits
                    prepared, returns = token_returns(self.loss.returns, prepared, values, self.device)
        if self.teacher is not None:
            start = time.perf_counter()
            with self.timer.section("teacher"), self.teacher.resident():
                prepared = passes.reference_pass(self.passes, self.teacher, prepared, field="teacher_logp")
            if not self.pipelined or pipeline.is_last_stage():
                prepared, distill = distill_advantages(prepared, self.config.algo.distill.coef, self.device)
                returns |= distill
            returns["distill/teacher_s"] = time.perf_counter() - start
        metrics = update.reduce_metrics(found, "old/", self.device) | returns
        if self.pipelined:
            metrics = pipeline.merge_stage_metrics(metrics, self._replayed_routers)
        return prepared, metrics

    # ------------------------------------------------------------------ update
    def _to_device(self, micro_batches: Sequence[TrainMicroBatch]) -> list[TrainMicroBatch]:
        """The boundary: each micro-batch on this worker's device (moved once; as it is after)."""
        return [mb.to(self.device) for mb in micro_batches]

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
        mini_batch = self._to_device(mini_batch)
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        denom = torch.stack([self.loss.local_denominator(mb, self.device) for mb in mini_batch]).sum()
        loss_sum, metrics = passes.update_pass(
            self.passes,
            self.ddp,
            mini_batch,
            self.step,
            lambda mb, logp: self.loss.micro_loss(mb, logp, self.timer),
        )
        with self.timer.section("grad_sync"):
            finalize_model_grads([self.ddp], num_tokens=denom)  # all-reduces denom over DP x CP
        return loss_sum, denom, metrics

    def train_step(self, mini_batch: Sequence[TrainMicroBatch]) -> dict[str, float]:
        """One optimizer step on a mini-batch of micro-batches (this rank's share), then the
        critic's on the same mini-batch; metrics. In the critic's warm-up (``critic.warmup_steps``)
        the critic's step is the only one."""
        mini_batch = self._to_device(mini_batch)
        if self.critic is None:
            return self._policy_step(mini_batch)
        warm_up = self.critic.step < self.config.critic.warmup_steps
        result = {"train/policy_frozen": 1.0} if warm_up else self._policy_step(mini_batch)
        with self.timer.section("critic"):
            critic = self.critic.train_step(self.passes, mini_batch, self.device)
        if self.pipelined:
            critic = pipeline.merge_stage_metrics(critic, 0)
        return result | critic

    def _policy_step(self, mini_batch: Sequence[TrainMicroBatch]) -> dict[str, float]:
        loss_sum, global_denom, metrics = self.accumulate_gradients(mini_batch)
        lr_scale = (
            update.vcpo_scale(mini_batch, self.device, self.pipelined)
            if self.config.trainer.vcpo_lr_scaling
            else 1.0
        )
        with self.timer.section("optimizer"):
            ok, grad_norm = update.optimizer_step(self.optimizer, self.scheduler, lr_scale)
        result = update.reduce_metrics(metrics, "train/", self.device)
        lr = float(self.optimizer.param_groups[0]["lr"])
        result.update(update.step_metrics(loss_sum, global_denom, ok, grad_norm, lr_scale, lr, self.step))
        self.step += 1
        if self.pipelined:
            result = pipeline.merge_stage_metrics(result, self._replayed_routers)
        return result

    @property
    def _replayed_routers(self) -> int:
        """The MoE routers of this rank's stage under routing replay (0 without replay): the weight of
        its routing metrics when the pipeline's stages merge theirs."""
        return len(self.replay.routers) if self.replay is not None else 0

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save model, optimizer, schedule, RNG, step and, with a KL penalty, the reference policy
        (`moe_rl.trainer.checkpoint`)."""
        return checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore everything `save_checkpoint` wrote; returns the step."""
        return checkpoint.load(self, directory)
