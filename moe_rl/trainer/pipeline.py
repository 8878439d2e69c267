"""Pipeline-parallel passes (PP > 1) through Megatron-core's 1F1B schedule.

With ``parallel.pipeline_model_parallel_size > 1`` the worker's two passes run through
``get_forward_backward_func()`` (Megatron's non-interleaved 1F1B schedule; on CPU with gloo
thanks to `moe_rl.megatron.compat`'s schedule shim). Each micro-batch is one packed sequence whose length
varies, so the transformer config runs with ``variable_seq_lengths`` (the schedule sends each
activation's shape before the activation).

Per micro-batch, in the schedule's ``forward_step``: routing is set up for this stage's own MoE
layers (R3 / R2 replay through `RoutingReplay`, which takes the stage's columns of a full-model
trace; natural-routing capture for the agreement metric), the stage's forward runs, and under
replay the routers switch to ``REPLAY_BACKWARD`` so an activation recompute in the backward pops
the same ids (1F1B runs the backwards of a stage in forward order). On the last stage the loss
function receives the logits and calls back into the worker (log-probs, corrections, objective).

Stage-local results are merged over the pipeline group by `merge_stage_metrics`: routing metrics
are averaged over stages weighted by their MoE layer counts; all other metrics come from the
last stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.device import process_device
from moe_rl.megatron.forward import check_on_model_device, packed_seq_params, pad_micro_batch, whole_vocab
from moe_rl.trainer.batch import TrainMicroBatch

ROUTING_KEYS = ("routing_agreement", "routing_overlap")


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[TrainMicroBatch],
    forward_only: bool,
    before_forward: Callable[[TrainMicroBatch], None],
    after_forward: Callable[[TrainMicroBatch], None],
    on_logits: Callable[[TrainMicroBatch, Tensor], Tensor],
    pad_length: Callable[[TrainMicroBatch], int | None],
    gather: Callable[[Tensor], Tensor] = whole_vocab,
) -> None:
    """Run the 1F1B schedule over ``micro_batches`` (forward only, or forward and backward).

    ``before_forward`` / ``after_forward`` run around each micro-batch's forward on every stage;
    ``on_logits(mb, logits[T, V])`` runs on the last stage and returns the micro-batch's loss sum
    (what the backward starts from; ignored when ``forward_only``). ``gather`` makes the last
    stage's output whole (the vocabulary's shards gathered, or a critic's values as they are).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    config.variable_seq_lengths = True

    def loss_func(mb: TrainMicroBatch, output: Tensor):
        output = gather(output)
        logits = output.reshape(-1, output.shape[-1])[: mb.micro.num_tokens]
        loss_sum = on_logits(mb, logits)
        return loss_sum, torch.ones((), dtype=torch.int, device=logits.device), {}

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        check_on_model_device(mb.micro, chunk)
        tokens, positions, cu = pad_micro_batch(mb.micro, pad_length(mb))
        before_forward(mb)
        output = chunk(
            tokens[None], positions[None], attention_mask=None, packed_seq_params=packed_seq_params(cu)
        )
        after_forward(mb)
        return output, functools.partial(loss_func, mb)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(pad_length(mb) or mb.micro.num_tokens for mb in micro_batches),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def merge_stage_metrics(local: dict[str, float], replayed_routers: int) -> dict[str, float]:
    """One metrics dict for every rank of the pipeline group (see the module docstring)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (local, replayed_routers, is_last_stage()), group=group)
    last = next(found for found, _, is_last in gathered if is_last)
    merged = {name: value for name, value in last.items() if not name.endswith(ROUTING_KEYS)}
    names = {name for found, _, _ in gathered for name in found if name.endswith(ROUTING_KEYS)}
    for name in sorted(names):
        parts = [(found[name], layers) for found, layers, _ in gathered if name in found and layers]
        total = sum(layers for _, layers in parts)
        if total:
            merged[name] = sum(value * layers for value, layers in parts) / total
    return merged


def broadcast_from_last_stage(value: float) -> float:
    """``value`` as the last pipeline stage has it, on every rank of the pipeline group."""
    from megatron.core import parallel_state as ps

    tensor = torch.full((1,), value, dtype=torch.float64, device=process_device())
    dist.broadcast(
        tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return float(tensor)
