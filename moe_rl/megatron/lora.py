"""Low-rank adapters (LoRA) on Megatron's linear layers: the policy's weights frozen, ``A`` and ``B``
trained (``lora:`` section, `moe_rl.config.schema.LoraConfig`).

A target linear computes ``W·x + s·B·(A·dropout(x))`` with ``s = alpha / rank``; ``B`` starts at
zero, so a fresh adapter leaves the model as it was. The adapters are the layer spec's own linear
classes with the product added (`LoraColumnParallelLinear`, `LoraRowParallelLinear`, swapped into
the spec as `moe_rl.megatron.model` swaps the experts' module), so every path that builds, shards,
checkpoints or loads the linear sees them, and their tensors sit beside the weight they adapt:
``<linear>.lora_a`` ``[rank, in]`` and ``<linear>.lora_b`` ``[out, rank]``.

Tensor parallelism, by Megatron's own region functions, as the base linear splits its weight:

* column-parallel (``W`` split by output rows): ``A`` whole on every rank, ``B`` split as ``W``'s rows;
  ``A·x`` enters the tensor-parallel region (``copy_to``: the gradient of ``A·x`` is summed over the
  ranks, each of which sees only its rows of the output), so ``A``'s gradient is whole everywhere;
* row-parallel (``W`` split by input columns): ``A`` split as ``W``'s columns, ``B`` whole; the
  partial ``A·x`` is summed over the ranks (``reduce_from``), as the base's output is.

With sequence parallelism (the activations between the linears split over the ranks by sequence),
the adapter follows the base linear's own communication:

* column-parallel: ``A`` reads the input gathered over the sequence
  (``gather_from_sequence_parallel_region``, whose backward reduce-scatters the input's gradient,
  as the base's does); each rank's ``A`` gradient is then its output rows' part, which Megatron's
  `finalize_model_grads` sums over the tensor-parallel ranks (``A.sequence_parallel``, as it does a
  layer norm's);
* row-parallel: the partial ``A·x`` is summed and split by sequence
  (``reduce_scatter_to_sequence_parallel_region``), as the base's output is; ``B`` then sees only
  its rank's tokens, and its gradient is summed the same way (``B.sequence_parallel``).

An expert's linears (ETP 1: `moe_rl.megatron.rules`) hold one adapter per expert, expert-parallel
like the expert's weights (``allreduce=False``: Megatron's DDP reduces them over the expert-data-
parallel group). Checkpoints shard ``B`` (column) and ``A`` (row) with the weight's axis.

`merged_weight` is what the linear computes as one matrix, ``W + s·B·A`` (its local shard): the
weight sync and the export read it (`moe_rl.megatron.hf_weights`), so engines and HF folders get
the merged model. `freeze_base` leaves only adapters (and, asked for, the routers or the output layer) trainable
(`trains`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor

from moe_rl.config.modes import LoraInit
from moe_rl.config.schema import LoraConfig

ADAPTER_NAMES = ("lora_a", "lora_b")
"""The adapter tensors' names inside a linear (``<linear>.lora_a``, ``<linear>.lora_b``)."""


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter tensor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


class _LoraMixin:
    """The adapter of a Megatron linear; ``lora`` is set on the class `lora_classes` makes."""

    lora: LoraConfig

    def _make_adapter(self, a_shape: tuple[int, int], b_shape: tuple[int, int], a_split: bool) -> None:
        cfg = self.lora
        dtype = self.weight.dtype
        a = torch.empty(a_shape, dtype=dtype, device=self.weight.device)
        full_in = a_shape[1] * (self.tp_group.size() if a_split else 1)
        if cfg.init == LoraInit.KAIMING:  # torch's Linear default, over the full input width
            bound = 1.0 / math.sqrt(full_in)
            a.uniform_(-bound, bound)
        else:
            a.normal_(0.0, 1.0 / cfg.rank)
        self.lora_a = torch.nn.Parameter(a)
        self.lora_b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=self.weight.device))
        for param, split_dim in (
            (self.lora_a, 1 if a_split else None),
            (self.lora_b, None if a_split else 0),
        ):
            param.allreduce = not self.is_expert  # experts: reduced over the expert-data-parallel group
            if split_dim is not None:
                param.tensor_model_parallel = True
                param.partition_dim = split_dim
                param.partition_stride = 1
        self.lora_scale = cfg.alpha / cfg.rank
        self.lora_dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()

    @property
    def _sequence_split(self) -> bool:
        """Activations split by sequence over more than one tensor-parallel rank (not an expert's:
        its communication is the dispatcher's)."""
        return self.sequence_parallel and self.tp_group.size() > 1 and not self.explicit_expert_comm

    def _with_adapter(self, out: Tensor, input_: Tensor, region) -> Tensor:
        """``out`` plus ``s·B·(A·dropout(x))``, ``A·x`` through the tensor-parallel ``region``
        (Megatron's mapping for this linear's split, None: none; not for an expert, whose
        communication is the dispatcher's)."""
        low = torch.matmul(self.lora_dropout(input_), self.lora_a.t())
        if region is not None and self.tp_group.size() > 1 and not self.explicit_expert_comm:
            low = region(low, group=self.tp_group)
        return out + self.lora_scale * torch.matmul(low, self.lora_b.t())

    def _mark_sequence_parallel(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient is a part per tensor-parallel rank (each saw its tokens, or its rows'
        share): Megatron's `finalize_model_grads` sums it over the ranks. Not an expert's (its tokens
        are the dispatcher's, its adapter whole on its rank)."""
        param.sequence_parallel = self.sequence_parallel and not self.explicit_expert_comm

    def _sharded(self, prefix: str, sharded_offsets, metadata, axes: dict[str, int]):
        """The linear's checkpoint tensors with ``axes`` (name -> the tensor-parallel split axis)."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip

    def merged_weight(self) -> Tensor:
        """``W + s·B·A``: this rank's shard of the linear's one matrix (detached)."""
        with torch.no_grad():
            delta = self.lora_b.float() @ self.lora_a.float()
            return (self.weight.float() + self.lora_scale * delta).to(self.weight.dtype)


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` plus an adapter: ``A`` whole, ``B`` split as the weight's rows."""

    def __init__(self, input_size: int, output_size: int, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        if self.gather_output:
            raise ValueError(
                "a LoRA column-parallel linear adds its product to an output split over the ranks"
            )
        self._make_adapter(
            (self.lora.rank, input_size), (self.weight.shape[0], self.lora.rank), a_split=False
        )
        self._mark_sequence_parallel(self.lora_a)

    def forward(self, input_: Tensor, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if self._sequence_split:  # the whole sequence's input, as the base's matmul reads it
            whole = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            return self._with_adapter(out, whole, None), bias
        return self._with_adapter(out, input_, copy_to_tensor_model_parallel_region), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight's sharding (axis 0) for ``lora_b`` too; ``lora_a`` whole on every rank."""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_b": 0})


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """``RowParallelLinear`` plus an adapter: ``A`` split as the weight's columns, ``B`` whole."""

    def __init__(self, input_size: int, output_size: int, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("a LoRA row-parallel linear reads an input already split over the ranks")
        self._make_adapter(
            (self.lora.rank, self.weight.shape[1]), (output_size, self.lora.rank), a_split=True
        )
        self._mark_sequence_parallel(self.lora_b)

    def forward(self, input_: Tensor, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        # summed over the ranks (and, with sequence parallelism, split by sequence), as the base's output
        region = (
            reduce_scatter_to_sequence_parallel_region
            if self._sequence_split
            else reduce_from_tensor_model_parallel_region
        )
        return self._with_adapter(out, input_, region), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight's sharding (axis 1) for ``lora_a`` too; ``lora_b`` whole on every rank."""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1, "lora_a": 1})


def lora_classes(cfg: LoraConfig) -> dict[type, type]:
    """Megatron's local linear class -> its adapter class carrying ``cfg``."""
    return {
        ColumnParallelLinear: type("LoraColumnParallelLinear", (LoraColumnParallelLinear,), {"lora": cfg}),
        RowParallelLinear: type("LoraRowParallelLinear", (LoraRowParallelLinear,), {"lora": cfg}),
    }


def has_adapter(module: torch.nn.Module) -> bool:
    return isinstance(module, _LoraMixin)


def adapted_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name -> every linear of ``model`` that carries an adapter."""
    return {name: module for name, module in model.named_modules() if has_adapter(module)}


OUTPUT_LAYER = ("output_layer.weight", "embedding.word_embeddings.weight")
"""The output layer's weight: its own, or (tied embeddings) the embedding it shares."""


def trains(model: torch.nn.Module, cfg: LoraConfig) -> Callable[[str], bool]:
    """Whether a tensor of ``model`` (by its name) trains in a LoRA run: the adapters, and with
    ``cfg.train_router`` the routers' weights, with ``cfg.train_output_layer`` the output layer's.
    The one rule: `freeze_base` keeps them trainable, an adapter-only sync sends them."""
    while hasattr(model, "module"):  # DDP and precision wrappers
        model = model.module
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    head = OUTPUT_LAYER if tied else OUTPUT_LAYER[:1]

    def trainable(name: str) -> bool:
        return (
            is_adapter(name)
            or (cfg.train_router and ".mlp.router." in f".{name}")
            or (cfg.train_output_layer and name in head)
        )

    return trainable


def freeze_base(model: torch.nn.Module, cfg: LoraConfig) -> int:
    """Only what trains (`trains`) keeps ``requires_grad``; the number of trainable elements."""
    trainable, count = trains(model, cfg), 0
    for name, param in model.named_parameters():
        keep = trainable(name)
        param.requires_grad_(keep)
        count += param.numel() if keep else 0
    return count
