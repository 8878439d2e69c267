"""Optimizer and learning-rate schedule for the trainer.

On CUDA: ``megatron.core.optimizer.get_megatron_optimizer`` (AdamW, mixed precision, optional
distributed optimizer), with its own gradient clipping.

Without CUDA Megatron's optimizer cannot be built: ``FP32Optimizer.__init__`` runs
``torch.tensor([1.0], device='cuda')`` (megatron/core/optimizer/optimizer.py:907, ``AssertionError:
Torch not compiled with CUDA enabled``) and ``clip_grads.get_grad_norm_fp32`` allocates on
``device='cuda'`` too. `TorchAdamW` stands in there: ``torch.optim.AdamW`` over the gradients
Megatron's ``DistributedDataParallel`` accumulated in ``param.main_grad``, Megatron's weight
decay grouping (no decay on biases and 1-D tensors), and the same clipping rule (global L2
norm over dense parameters reduced over the model-parallel group plus expert parameters
reduced over the expert-model-parallel group; shared and tensor-parallel-duplicate tensors
counted once). It exposes what the worker uses of a ``MegatronOptimizer``: ``step() ->
(ok, grad_norm, num_zeros)``, ``zero_grad``, ``param_groups``, ``state_dict`` /
``load_state_dict`` and ``sharded_state_dict`` for ``dist_checkpointing`` (built with
Megatron's ``dist_checkpointing.optimizer`` helpers, as ``FP32Optimizer`` does).

The schedule is Megatron's ``OptimizerParamScheduler`` in both cases.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.config.modes import LrDecay
from moe_rl.config.schema import TrainerConfig
from moe_rl.megatron.compat import cuda_available
from moe_rl.megatron.model import PRECISIONS

log = logging.getLogger(__name__)


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default: biases and 1-D tensors (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def _counted_once(param: torch.nn.Parameter) -> bool:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


class TorchAdamW:
    """``torch.optim.AdamW`` over ``param.main_grad`` with Megatron-style clipping (CPU stand-in)."""

    def __init__(self, model_chunks: list[torch.nn.Module], trainer: TrainerConfig):
        decay, no_decay = [], []
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    (no_decay if _no_weight_decay(name, param) else decay).append(param)
        groups = [
            {"params": decay, "wd_mult": 1.0, "default_config": True},
            {"params": no_decay, "wd_mult": 0.0, "default_config": True},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
        )
        self.clip_grad = trainer.grad_clip

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        for param in self.parameters():
            param.grad = None

    def _load_grads(self) -> None:
        for param in self.parameters():
            grad = getattr(param, "main_grad", None)
            param.grad = None if grad is None else grad.to(param.dtype)

    def grad_norm(self) -> Tensor:
        """Global L2 norm of the gradients (see the module docstring for the reduction)."""
        from megatron.core import parallel_state as ps

        device = self.parameters()[0].device
        dense = torch.zeros((), dtype=torch.float32, device=device)
        expert = torch.zeros((), dtype=torch.float32, device=device)
        for param in self.parameters():
            if param.grad is None or not _counted_once(param):
                continue
            square = param.grad.detach().float().pow(2).sum()
            if getattr(param, "allreduce", True):
                dense += square
            else:
                expert += square
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
            dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return (dense + expert).sqrt()

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip (when ``grad_clip > 0``) and step; returns ``(ok, grad_norm, None)``.

        A non-finite gradient norm skips the update (``ok=False``), as Megatron does.
        """
        self._load_grads()
        norm = self.grad_norm()
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            log.warning("non-finite gradient norm %s: optimizer step skipped", norm_value)
            return False, norm_value, None
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm_value + 1e-6)
            if coeff < 1.0:
                for param in self.parameters():
                    if param.grad is not None:
                        param.grad.mul_(coeff)
        self.optimizer.step()
        return True, norm_value, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = copy.copy(state_dict)
        state = dict(state_dict["state"])
        step = state.pop("common_step", None)
        if step is not None:
            for param_state in state.values():
                param_state["step"] = copy.deepcopy(step)
        state_dict["state"] = state
        self.optimizer.load_state_dict(state_dict)

    def _init_state(self) -> None:
        for param in self.parameters():
            if not self.optimizer.state[param]:
                self.optimizer.state[param]["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
                self.optimizer.state[param]["exp_avg"] = torch.zeros_like(param.data)
                self.optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The optimizer state as ``dist_checkpointing`` sharded tensors keyed like the model's."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:
            self._init_state()
        state_dict = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer steps differ per parameter ({sorted(steps)}); cannot checkpoint")
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.parameters())
        optim_state_to_sharding_state(state_dict, id_map, exclude_keys="step")
        if steps:
            state_dict["state"]["common_step"] = torch.tensor(steps.pop(), dtype=torch.float32, device="cpu")
        return state_dict


def optimizer_state_tensors(optimizer) -> list[Tensor]:
    """Every tensor of an optimizer's state (each part of a chained one): the moments and, under mixed
    precision, the float32 main copies of the parameters."""
    out: list[Tensor] = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", part)
        for state in inner.state.values():
            out += [value for value in state.values() if torch.is_tensor(value)]
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(part, attr, None) or []:
                out += [t for t in group if t is not None]
    return out


def build_optimizer(
    model_chunks: list[torch.nn.Module], trainer: TrainerConfig, use_distributed: bool = False
):
    """Megatron's optimizer on CUDA, `TorchAdamW` without it (see the module docstring)."""
    if not cuda_available():
        if use_distributed:
            raise ValueError("parallel.use_distributed_optimizer=true needs CUDA (Megatron's optimizer)")
        return TorchAdamW(model_chunks, trainer)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = PRECISIONS[trainer.precision]
    config = OptimizerConfig(
        optimizer="adam",
        lr=trainer.lr,
        min_lr=trainer.min_lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        adam_eps=trainer.adam_eps,
        clip_grad=trainer.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(optimizer, trainer: TrainerConfig, total_steps: int):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up, then constant / linear / cosine."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if trainer.lr_decay_style not in (LrDecay.CONSTANT, LrDecay.LINEAR, LrDecay.COSINE):
        raise ValueError(
            f"trainer.lr_decay_style='{trainer.lr_decay_style}'; valid: constant, linear, cosine"
        )
    decay_steps = max(total_steps, trainer.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if trainer.lr_warmup_steps > 0 else trainer.lr,
        max_lr=trainer.lr,
        min_lr=trainer.min_lr,
        lr_warmup_steps=trainer.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=str(trainer.lr_decay_style),  # a plain string: the scheduler state is checkpointed
        start_wd=trainer.weight_decay,
        end_wd=trainer.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
