"""The critic of PPO with GAE (``algo.advantage=gae``): a value model trained beside the policy on
the same trainer ranks.

The model is a Megatron ``GPTModel`` of the recipe's family and layout, built as the policy is
(same transformer config, same parallel layout: each rank holds the same shard of the same layers
as its policy, so every layout the trainer supports, TP / PP / EP / DP, holds a critic), whose
output layer is a `ValueHead`: one scalar per position instead of the vocabulary's logits. Its
body starts from the policy's starting weights, from its own initialization or from a trainer
checkpoint (``critic.init``); the head starts at zero, so the first values are 0. It routes by its
own routers (no routing replay: the replayed routing is the policy's).

Per step, on the micro-batches the policy's passes use:

* `values_pass` (in the π_old pass, no grad): ``V_t`` at each response token's state, read at the
  position before the token, where the policy's logits predict it;
* `update_pass` (after each policy step, on the same mini-batch): the clipped value loss against the
  GAE returns (`moe_rl.algo.value.value_loss`), its gradients summed over micro-batches and
  data-parallel ranks and divided by the mini-batch's token count, clipping and its own Adam step.

The critic's optimizer, schedule and step count are its own (``critic.lr``, ``critic.grad_clip``,
``critic.weight_decay``; a constant learning rate). Checkpoints hold its weights under ``critic.``
keys and its optimizer beside them (`moe_rl.trainer.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from moe_rl.algo import registry
from moe_rl.config.modes import LrDecay
from moe_rl.config.schema import RecipeConfig, TrainerConfig
from moe_rl.megatron.lora import is_adapter
from moe_rl.megatron.model import build_gpt_model
from moe_rl.trainer import passes, update
from moe_rl.trainer.batch import TrainMicroBatch
from moe_rl.trainer.optim import build_optimizer, build_scheduler

log = logging.getLogger("moe_rl.trainer.worker")

PREFIX = "critic."
"""Checkpoint keys of the critic's weights (its optimizer's keys derive from them)."""

HEAD = "output_layer."
"""State-dict keys of the output layer, which the critic's body does not take from a policy."""


class ValueHead(torch.nn.Module):
    """The critic's output layer: ``V = h·w`` at every position, ``w`` of ``[1, hidden]`` (zero at
    the start), replicated on every tensor-parallel rank. It takes the call of Megatron's output
    layer (``weight``, ``runtime_gather_output`` are the logits' own and unused) and returns
    ``(values [s, b, 1], None)``. Under sequence parallelism the hidden states are gathered first,
    their gradient split back: every tensor-parallel rank computes the whole loss alike."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


def body_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """A policy's state dict without its output layer (nor LoRA adapters, which start at zero): what
    a critic's body takes."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(HEAD) and not is_adapter(k)}


def build_critic_model(config: RecipeConfig, source: torch.nn.Module | None) -> torch.nn.Module:
    """The critic's ``GPTModel`` for this pipeline stage (see the module docstring): its body from
    ``source`` (a policy-shaped model, `moe_rl.trainer.checkpoint.critic_start`; None: its own
    initialization from ``run.seed`` + 1), a `ValueHead` on the last stage."""
    from megatron.core import parallel_state as ps

    untied = dataclasses.replace(config.model, tie_word_embeddings=False)
    seed = config.run.seed + (1 if source is None else 0)
    model = build_gpt_model(untied, config.parallel, config.trainer, seed=seed)
    if source is not None:
        missing, unexpected = model.load_state_dict(body_state(source), strict=False)
        wrong = [k for k in missing if not k.startswith(HEAD)] + list(unexpected)
        assert not wrong, f"the critic's body and the policy differ in {wrong[:4]}"
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        param = next(model.parameters())
        model.output_layer = ValueHead(
            config.model.hidden_size, param.dtype, param.device, config.parallel.sequence_parallel
        )
    return model


def critic_trainer(config: RecipeConfig) -> TrainerConfig:
    """The trainer settings the critic's optimizer and schedule are built from: the trainer's, with
    the critic's learning rate (constant), weight decay and clip."""
    critic = config.critic
    return dataclasses.replace(
        config.trainer, lr=critic.lr, min_lr=critic.lr, lr_warmup_steps=0, lr_decay_style=LrDecay.CONSTANT,
        weight_decay=critic.weight_decay, grad_clip=critic.grad_clip,
    )  # fmt: skip


class Critic:
    """The critic of one trainer rank: its model in Megatron's ``DistributedDataParallel``, its
    optimizer and schedule, its loss and step count (see the module docstring)."""

    def __init__(self, config: RecipeConfig, source: torch.nn.Module | None, wrap_ddp, total_steps: int):
        """``source``: the model whose body the critic starts from (`build_critic_model`);
        ``wrap_ddp``: how the worker wraps a model in ``DistributedDataParallel``; ``total_steps``:
        the critic's optimizer steps in the run."""
        self.model = build_critic_model(config, source)
        self.ddp = wrap_ddp(self.model)
        trainer = critic_trainer(config)
        self.optimizer = build_optimizer([self.ddp], trainer, config.parallel.use_distributed_optimizer)
        self.scheduler = build_scheduler(self.optimizer, trainer, total_steps)
        self.loss = registry.bind_value_loss(config.critic.clip)
        self.step = 0

    def grad_buffers(self) -> list[Tensor]:
        return [buffer.grad_data for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers]

    def values(self, ctx: passes.PassContext, micro_batches: Sequence[TrainMicroBatch]) -> dict[int, Tensor]:
        """``V_t`` [R] of every micro-batch (no grad), by ``id(mb)`` (last pipeline stage only)."""
        self.ddp.eval()
        found: dict[int, Tensor] = {}

        def on_values(mb: TrainMicroBatch, values: Tensor) -> Tensor:
            found[id(mb)] = values.detach().float()
            return values.new_zeros(())

        with torch.no_grad():
            passes.value_pass(ctx, self.ddp, micro_batches, True, on_values)
        return found

    def train_step(
        self, ctx: passes.PassContext, mini_batch: Sequence[TrainMicroBatch], device: torch.device
    ) -> dict[str, float]:
        """One optimizer step of the critic on a mini-batch that carries ``old_values`` and
        ``returns`` (the π_old pass's); the ``critic/*`` metrics."""
        from megatron.core.distributed import finalize_model_grads

        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        tokens = sum(mb.micro.response_positions.numel() for mb in mini_batch)
        denom = torch.tensor(float(tokens), device=device)  # the mini-batch's response tokens
        loss_sum = torch.zeros((), device=device)
        metrics: list[dict[str, Tensor]] = []

        def on_values(mb: TrainMicroBatch, values: Tensor) -> Tensor:
            nonlocal loss_sum
            mask = torch.ones_like(values, dtype=torch.bool)
            out = self.loss(
                values=values.float(), old_values=mb.old_values, returns=mb.returns, loss_mask=mask,
                seq_ids=mb.seq_ids, num_seqs=mb.num_samples,
            )  # fmt: skip
            metrics.append(out.metrics)
            loss_sum = loss_sum + out.loss_sum.detach()
            return out.loss_sum

        passes.value_pass(ctx, self.ddp, mini_batch, False, on_values)
        finalize_model_grads([self.ddp], num_tokens=denom)  # all-reduces denom over DP x CP
        ok, grad_norm = update.optimizer_step(self.optimizer, self.scheduler, 1.0)
        result = update.reduce_metrics(metrics, "critic/", device)
        total = update.all_reduce_dp(loss_sum.double().clone())
        result["critic/loss"] = float(total / denom.double().clamp_min(1e-12))
        result["critic/grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
        result["critic/update_ok"] = float(ok)
        self.step += 1
        return result

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, is_loading: bool) -> dict:
        """The critic's weights (``critic.`` keys), optimizer and schedule for ``dist_checkpointing``."""
        model_sd = self.model.sharded_state_dict(prefix=PREFIX)
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_sharded(self, state: dict) -> None:
        """Take what `sharded_state_dict` saved."""
        self.model.load_state_dict({key.removeprefix(PREFIX): value for key, value in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])


def saved_with_critic(directory: str | Path) -> bool:
    """Whether the checkpoint in ``directory`` holds a critic (saved by a run with one)."""
    from megatron.core import dist_checkpointing

    return any(key.startswith(PREFIX) for key in dist_checkpointing.load_tensors_metadata(str(directory)))
