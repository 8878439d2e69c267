"""torch.distributed + Megatron-core parallel state for the trainer, idempotent, with teardown.

`init_parallel` starts (or joins) the process group and calls
``megatron.core.parallel_state.initialize_model_parallel`` with the recipe's TP / PP / VPP /
CP / EP / ETP sizes; data parallelism is what is left of the world. It is the process setup of
every process that builds a Megatron model: it applies the compatibility shims the process needs
(`compat.apply_process_shims`), selects the process's CUDA device (``LOCAL_RANK``) and
uses NCCL where the process sees CUDA, gloo where it does not. A process launched by ``torchrun`` (or any launcher that
sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``) joins that world; a plain process
gets a world of one on an in-memory store.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config.schema import ParallelConfig
from moe_rl.megatron.compat import apply_process_shims, cuda_available
from moe_rl.megatron.rules import check_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits in the Megatron layout (what the trainer group reports of a rank)."""

    rank: int
    dp_rank: int
    dp_size: int
    pp_rank: int


def _sizes(parallel: ParallelConfig) -> dict[str, int | None]:
    return {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
    }


def _init_process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    log.debug("process group %s: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def _check_matches(parallel: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps

    have = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
    }
    want = _sizes(parallel)
    for name, value in have.items():
        if value != want[name]:
            raise ValueError(
                f"Megatron parallel state is already initialized with {name}={value}; "
                f"parallel.{name}={want[name]} differs (call teardown_parallel() first)"
            )


def init_parallel(parallel: ParallelConfig) -> ParallelInfo:
    """Initialize torch.distributed (nccl with CUDA, gloo without) and Megatron's parallel groups
    once; later calls check and return the same layout."""
    from megatron.core import parallel_state as ps

    apply_process_shims()
    if cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _init_process_group("nccl" if cuda_available() else "gloo")
    check_layout(parallel, dist.get_world_size())
    if ps.model_parallel_is_initialized():
        _check_matches(parallel)
    else:
        ps.initialize_model_parallel(**_sizes(parallel))
    return current_info()


def current_info() -> ParallelInfo:
    """The layout of this process (Megatron's parallel state must be initialized)."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
    )


def teardown_parallel() -> None:
    """Destroy Megatron's parallel groups and the default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
