"""The sending side of a weight sync: which trainer rank sends which tensor, as a bucket stream.

Every rank of the trainer group iterates its tensors together (tensor-parallel shards are
all-gathered, a collective), and one rank per distinct tensor sends it:

* a dense tensor (attention, norms, shared experts, embeddings, the LM head): the rank with data-
  parallel rank 0 (context parallel included) and tensor-parallel rank 0 of its pipeline stage;
* an expert tensor: the rank with expert-data-parallel rank 0 and expert-tensor-parallel rank 0
  of its expert-parallel group, so each expert-parallel rank sends its own experts.

So each pipeline stage and each expert-parallel rank sends what it owns, nobody sends a tensor
twice, and no rank gathers more than one tensor at a time.

A CPU rank whose engines share its node keeps its parameters in shared memory (`share_parameters`):
a tensor that travels as it is (an expert's weight, a norm; not a quantized or gathered one) is then
read by the engines where the trainer holds it, and only the rest is written into the shared slots.

`RankSender` is one rank's side of every sync: it owns the rank's transport (chosen from where the
receivers are, `transport.Reach`, and kept from sync to sync with its buffers or shared slots), the
shared arena, the encoder of the quantization recipe, and the bucket stream; `publish` delivers the
buckets to the receivers with at most two in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from moe_rl.config.derived import WeightBackend
from moe_rl.config.schema import QuantConfig
from moe_rl.weight_sync import shm
from moe_rl.weight_sync.buckets import Bucket, BucketPacker
from moe_rl.weight_sync.report import SyncReport
from moe_rl.weight_sync.shm import SharedArena, tensor_nbytes
from moe_rl.weight_sync.transport import (
    DeviceIpc,
    InProcess,
    Mixed,
    ProcessGroup,
    Reach,
    SharedMemory,
    Transport,
    publish,
)
from moe_rl.weight_sync.wire import LazyGroup, WireEncoder

EXPERT_MARK = ".mlp.experts."


def sends(megatron_name: str) -> bool:
    """Whether this rank is the one that sends ``megatron_name`` (see the module docstring)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    if EXPERT_MARK in megatron_name:
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )


def share_parameters(
    model: torch.nn.Module, tag: str = "0", select: Callable[[str], bool] | None = None
) -> SharedArena | None:
    """Move ``model``'s CPU parameters (those whose name ``select`` accepts: a rank passes `sends`, so
    a rank that sends nothing keeps its memory) into one `shm.SharedArena`, in place: each
    ``param.data`` is replaced by a copy in the arena; the ``Parameter`` objects, which the optimizer,
    its state and the gradient hooks hold, stay the same. Only a parameter that is the one user of
    its whole storage moves (not a view into a flat buffer, e.g. Megatron's distributed-optimizer
    parameter buffer, or storage two parameters share): those keep their memory and travel through
    the slots as before.
    Returns the arena (None when nothing moved, or when ``/dev/shm`` has no room for it: then every
    tensor travels through the slots); the caller keeps it and closes it when done."""
    users: dict[int, list[torch.nn.Parameter]] = {}
    chosen: set[int] = set()
    for name, param in model.named_parameters():  # a tied weight once
        data = param.data
        if data.device.type == "cpu" and data.numel() > 0:
            users.setdefault(data.untyped_storage().data_ptr(), []).append(param)
            if select is None or select(name):
                chosen.add(id(param))
    movable = [
        group[0]
        for group in users.values()
        if len(group) == 1
        and id(group[0]) in chosen
        and group[0].data.is_contiguous()
        and group[0].data.storage_offset() == 0
        and group[0].data.untyped_storage().nbytes() == tensor_nbytes(group[0])
    ]
    total = SharedArena.size_for(movable)
    if not movable or shm.slot_dir(total) != shm.SHM_DIR:
        # without room in shared memory the arena would be a file on disk, written back every step
        return None
    arena = SharedArena(total, tag)
    for param in movable:
        param.data = arena.place(param.data)
    return arena


def weight_groups(
    model: torch.nn.Module, encoder: WireEncoder, max_bytes: int | None = None
) -> Iterator[LazyGroup]:
    """What this rank sends, one Megatron tensor (all its HF pieces) at a time, encoded by the
    packer straight into the bucket; a tensor whose wire bytes exceed ``max_bytes`` (the bucket
    capacity) in row chunks (`WireEncoder.lazy_groups`)."""
    from moe_rl.megatron.hf_weights import iter_hf_weight_groups

    for _, group in iter_hf_weight_groups(model, select=sends, copy=False):  # views; the packer writes
        yield from encoder.lazy_groups(group, max_bytes)


def every_rank_groups(model: torch.nn.Module, encoder: WireEncoder | None, max_bytes: int | None = None):
    """The whole model on every rank, one Megatron tensor at a time (tensor-parallel shards and
    expert-parallel ranks' experts gathered: collectives, so every rank iterates it), encoded by the
    packer straight into the bucket (``encoder`` None: the raw groups, for a rank that only joins
    the gathers). Needs one pipeline stage. For receivers that take the whole model from the rank
    that shares their device (`transport.DeviceIpc`)."""
    from moe_rl.weight_sync.vllm_transfer import TrainerSource

    device = next(model.parameters()).device
    for group in TrainerSource(model, None, device, every_rank=True).groups():
        if encoder is None:
            yield group
        else:
            yield from encoder.lazy_groups(group, max_bytes)


def stream_buckets(
    model: torch.nn.Module,
    encoder: WireEncoder,
    capacity: int,
    rank: int = 0,
    packer: BucketPacker | None = None,
) -> Iterator[Bucket]:
    """This rank's buckets (none on ranks that own nothing; they still join the gathers). Each
    bucket is valid until the next is requested (`buckets.BucketPacker`); pass the rank's own
    ``packer`` to reuse its buffer from sync to sync."""
    packer = packer or BucketPacker(capacity, sender=rank)
    return packer.pack(weight_groups(model, encoder, packer.capacity))


class RankSender:
    """One trainer rank's side of every weight sync (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, quant: QuantConfig, num_layers: int, capacity: int, rank: int = 0,
        host: str | None = None, vllm_workers: int = 1, device_ipc: bool = False,
    ):  # fmt: skip
        """``host``: the address receivers on other nodes reach this rank at (its process group's
        store; default: this machine's name resolved). ``vllm_workers``: each engine's vLLM workers,
        for a sync by vLLM's NCCL backend (`send` with ``direct``). ``device_ipc``: the receivers of
        this rank are the engines that share its device (`moe_rl.config.derived.
        megatron_weights_ipc`); it sends them the whole model (`every_rank_groups`), whose buckets
        they read in its device memory (`transport.DeviceIpc`) instead of shared-memory slots.
        Every rank streams then, and one whose device hosts no engine only joins the gathers."""
        self.model, self.quant, self.num_layers = model, quant, num_layers
        self.capacity, self.rank, self.host, self.vllm_workers = capacity, rank, host, vllm_workers
        self.device_ipc = device_ipc
        self.transport: Transport | None = None
        self.arena: SharedArena | None = None
        self.source: Any = None  # what vLLM's NCCL backend sends (`vllm_transfer.source`), kept

    def _transport_for(self, reach: Reach, local: frozenset[int] = frozenset()) -> Transport:
        """The transport of ``reach``, kept while the receivers stay where they are (``local``: those
        on this node, for a mixed reach). A CPU rank whose receivers share its node moves its
        parameters into a shared arena, once."""
        device = next(self.model.parameters()).device
        if reach is Reach.SAME_NODE and self.device_ipc:
            if not isinstance(self.transport, DeviceIpc):
                if self.transport is not None:
                    self.transport.close()
                self.transport = DeviceIpc(self.capacity, self.rank, device)
            return self.transport
        if reach is Reach.SAME_NODE and self.arena is None and device.type == "cpu":
            self.arena = share_parameters(self.model, tag=str(self.rank), select=sends)
        moved = reach is Reach.MIXED and getattr(self.transport, "local", None) != local
        if self.transport is None or self.transport.reach is not reach or moved:
            if self.transport is not None:
                self.transport.close()
            kind = device.type
            self.transport = {
                Reach.IN_PROCESS: lambda: InProcess(self.capacity, self.rank),
                Reach.SAME_NODE: lambda: SharedMemory(self.capacity, self.rank, self.arena),
                Reach.OTHER_NODES: lambda: ProcessGroup(self.capacity, self.rank, self.host, kind),
                Reach.MIXED: lambda: Mixed(self.capacity, self.rank, self.host, kind, local),
            }[reach]()
        return self.transport

    def send(
        self,
        receivers: dict[int, Callable[[Any], Any]],
        reach: Reach,
        quantized_wire: bool,
        timeout_s: float,
        members: tuple = (),
        direct: WeightBackend | None = None,
        local: frozenset[int] = frozenset(),
    ) -> SyncReport:
        """Stream this rank's tensors to ``receivers`` (each encoded by the quantization recipe when
        the receivers take it on the wire); this rank's part of the sync's report. ``direct``: the
        receivers are vLLM engines on CUDA that take the weights straight from the trainer ranks by
        this vLLM backend (`moe_rl.weight_sync.vllm_transfer`, in the engines' dtype). ``local``:
        the receivers on this rank's node (with a mixed ``reach``)."""
        if direct is not None:
            return self._send_direct(WeightBackend(direct), receivers, timeout_s, members)
        encoder = WireEncoder(self.quant, self.num_layers, quantized_wire=quantized_wire)
        transport = self._transport_for(reach, frozenset(local))
        packer = transport.packer
        if isinstance(transport, DeviceIpc):  # the whole model to the engines on this rank's device
            if not receivers:
                for _ in every_rank_groups(self.model, None):  # the others' gathers
                    pass
                return SyncReport(senders=0, transports=set())
            buckets = packer.pack(every_rank_groups(self.model, encoder, packer.capacity))
            return self._report(transport.send(buckets, receivers, timeout_s, members), transport, encoder)
        buckets = stream_buckets(self.model, encoder, packer.capacity, self.rank, packer)
        if not self.owns_any:  # it still joins the gathers of what others send; nothing to deliver
            for _ in buckets:
                raise AssertionError(f"trainer rank {self.rank} owns no tensor but packed a bucket")
            return SyncReport(senders=0, transports=set())
        return self._report(transport.send(buckets, receivers, timeout_s, members), transport, encoder)

    @staticmethod
    def _report(out, transport: Transport, encoder: WireEncoder) -> SyncReport:
        return SyncReport(
            bytes=out.bytes, in_place=out.in_place, buckets=out.buckets, senders=1,
            shared_memory=transport.shared_memory, quant=encoder.report if encoder.active else None, dead=out.dead,
            transports=transport.names,
        )  # fmt: skip

    def _send_direct(
        self,
        backend: WeightBackend,
        receivers: dict[int, Callable[[Any], Any]],
        timeout_s: float,
        members: tuple,
    ) -> SyncReport:
        from moe_rl.weight_sync import vllm_transfer

        kind = vllm_transfer.VLLMNccl if backend == WeightBackend.NCCL else vllm_transfer.VLLMIpc
        if not isinstance(self.transport, kind):
            if self.transport is not None:
                self.transport.close()
            if kind is vllm_transfer.VLLMNccl:
                self.transport = kind(self.capacity, self.rank, self.host, self.vllm_workers)
            else:
                self.transport = kind(self.capacity, self.rank)
        if self.source is None or self.source.every_rank != kind.every_rank:
            device = next(self.model.parameters()).device
            select = None if kind.every_rank else sends  # IPC: every rank shares the whole model
            self.source = vllm_transfer.source(self.model, torch.bfloat16, device, select, kind.every_rank)
        if (
            self.rank != 0 and not kind.every_rank
        ):  # it joins the gathers (at the first sync also the metadata's)
            self.source.metadata()
            for _ in self.source:
                raise AssertionError(f"trainer rank {self.rank} yielded a tensor for vLLM's NCCL transfer")
            return SyncReport(senders=0, transports=set())
        out = self.transport.send_source(self.source, receivers if self.rank == 0 else {}, timeout_s, members)
        if self.rank != 0:  # it shared its GPU's copy; rank 0 reports the sync
            return SyncReport(senders=0, transports=set())
        return SyncReport(
            bytes=out.bytes, buckets=out.buckets, senders=1, shared_memory=False, dead=out.dead,
            transports={self.transport.name},
        )  # fmt: skip

    @functools.cached_property
    def owns_any(self) -> bool:
        """Whether this rank sends any tensor (`sends`): one that owns none never contacts the receivers."""
        return any(sends(name) for name, _ in self.model.named_parameters())

    def close(self) -> None:
        """Remove this rank's shared slots and arena file (before the process ends)."""
        if self.transport is not None:
            self.transport.close()
        if self.arena is not None:
            self.arena.close()
        self.transport = self.arena = None


def sync_in_process(
    receiver: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig, num_layers: int,
    version: int, quantized_wire: bool = True, capacity: int = 64 << 20,
) -> SyncReport:  # fmt: skip
    """A whole sync of ``named_tensors`` (HF names) into a receiver in this process (a
    `moe_rl.weight_sync.receiver.WeightReceiver`), through what a trainer rank uses: the recipe's
    encoder, buckets of ``capacity`` bytes, `publish` and the receiver protocol."""
    encoder = WireEncoder(quant, num_layers, quantized_wire=quantized_wire)
    transport = InProcess(capacity)
    groups = (g for item in named_tensors for g in encoder.lazy_groups([item], capacity))
    receiver.begin_weight_update(version)
    out = publish(transport.packer.pack(groups), {0: receiver.receive_bucket}, 0.0, transport)
    received = receiver.finish_weight_update(version)
    return SyncReport(
        version, bytes=out.bytes, in_place=out.in_place, buckets=out.buckets, senders=1, shared_memory=False,
        quant=encoder.report if encoder.active else None, received=received,
    )  # fmt: skip
