"""The sending side of a weight sync: a trainer rank's `RankSender`, `share_parameters`, `sync_in_process`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from moe_rl.config.modes import SyncRoute
from moe_rl.config.schema import LoraConfig, QuantConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.weight_sync import shm, vllm_transfer
from moe_rl.weight_sync.outgoing import Outgoing, SyncPart, owned, sends, whole_model
from moe_rl.weight_sync.report import SyncReport
from moe_rl.weight_sync.shm import SharedArena, tensor_nbytes
from moe_rl.weight_sync.transport import DeviceIpc, HostBuckets, InProcess, Receiver, Transport
from moe_rl.weight_sync.wire import WireEncoder


def share_parameters(
    model: torch.nn.Module, tag: str = "0", select: Callable[[str], bool] | None = None
) -> SharedArena | None:
    """Move ``model``'s CPU parameters (those ``select`` accepts) into one `shm.SharedArena`, where its
    engines on the node read a tensor that travels as it is. Each ``param.data`` is replaced by a copy
    there; the ``Parameter`` objects (held by the optimizer and the gradient hooks) stay. Only the one
    user of a whole storage moves (not a view into a flat buffer, nor a shared storage). The arena,
    which the caller closes; None when nothing moved or ``/dev/shm`` has no room for it."""
    users: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():  # a tied weight once
        if param.data.device.type == "cpu" and param.data.numel() > 0:
            users.setdefault(param.data.untyped_storage().data_ptr(), []).append((name, param))
    movable = [
        param
        for name, param in (group[0] for group in users.values() if len(group) == 1)
        if (select is None or select(name))
        and param.data.is_contiguous()
        and param.data.storage_offset() == 0
        and param.data.untyped_storage().nbytes() == tensor_nbytes(param)
    ]
    total = SharedArena.size_for(movable)
    if not movable or shm.slot_dir(total) != shm.SHM_DIR:
        # without room in shared memory the arena would be a file on disk, written back every step
        return None
    arena = SharedArena(total, tag)
    for param in movable:
        param.data = arena.place(param.data)
    return arena


class RankSender:
    """One trainer rank's side of every weight sync: the run's `SyncPlan`, each route's transport (made at its
    first sync, kept), the shared arena, each sync's `Outgoing`."""

    def __init__(
        self, model: torch.nn.Module, quant: QuantConfig, num_layers: int, plan: SyncPlan, rank: int = 0,
        host: str | None = None, vllm_workers: int = 1, lora: LoraConfig | None = None,
    ):  # fmt: skip
        """``host``: the address receivers on other nodes reach this rank at (default: this machine's
        name resolved); ``vllm_workers``: each engine's vLLM workers (vLLM's NCCL transfer); ``lora``:
        the run's adapters (what trains, for the plan's adapter-only syncs)."""
        if plan.adapters and (lora is None or lora.rank == 0):
            raise ValueError("a sync plan that sends LoRA adapters needs the run's lora settings")
        self.model, self.quant, self.num_layers, self.plan = model, quant, num_layers, plan
        self.lora = lora
        self.rank, self.host, self.vllm_workers = rank, host, vllm_workers
        self.device = next(model.parameters()).device
        self.transports: dict[SyncRoute, Transport] = {}
        self.arena: SharedArena | None = None
        self._shared = False

    def _transport(self, route: SyncRoute) -> Transport:
        if route not in self.transports:
            capacity, rank, host = self.plan.bucket_bytes, self.rank, self.host
            self.transports[route] = {
                SyncRoute.IN_PROCESS: lambda: InProcess(capacity, rank),
                SyncRoute.BUCKETS: lambda: HostBuckets(capacity, rank, host, self.device.type, self._arena),
                SyncRoute.DEVICE_IPC: lambda: DeviceIpc(capacity, rank, self.device),
                SyncRoute.VLLM_NCCL: lambda: vllm_transfer.VLLMNccl(capacity, rank, host, self.vllm_workers),
                SyncRoute.VLLM_IPC: lambda: vllm_transfer.VLLMIpc(capacity, rank),
            }[route]()
        return self.transports[route]

    def _arena(self) -> SharedArena | None:
        if not self._shared and self.device.type == "cpu":
            self.arena = share_parameters(self.model, tag=str(self.rank), select=sends)
        self._shared = True
        return self.arena

    def send(
        self, receivers: dict[int, Receiver], reference: bool = False, timeout_s: float = 1800.0,
        whole: bool = True,
    ) -> SyncReport:  # fmt: skip
        """One sync of this rank's weights to ``receivers`` (the engines, or with ``reference`` the
        probe's reference model) by the plan's route; this rank's part of the sync's report.
        ``whole`` False: with the plan's adapter sync, only what trains (the engines hold the base)."""
        route = self.plan.route_for(reference)
        quantized = self.plan.quantized_wire and not reference
        encoder = WireEncoder(self.quant, self.num_layers, quantized_wire=quantized)
        whole_model_route = route == SyncRoute.DEVICE_IPC
        part = self._part(reference, whole)
        tensors = functools.partial(whole_model if whole_model_route else owned, self.model, part=part)
        if not whole_model_route and not self.owns_any:
            receivers = {}  # it takes part in the gathers of what others send; nothing to deliver
        out = self._transport(route).send(Outgoing(tensors, encoder, self.model), receivers, timeout_s)
        return SyncReport(
            bytes=out.bytes, in_place=out.in_place, buckets=out.buckets, senders=int(bool(out.buckets)),
            shared_memory=out.shared_memory, quant=encoder.report if encoder.active and out.buckets else None,
            dead=out.dead, transports=out.transports, adapters_only=part.only is not None,
        )  # fmt: skip

    def _part(self, reference: bool, whole: bool) -> SyncPart:
        """What a sync carries: by the plan's adapter sync into the engines, the adapters apart from
        the weights, and once the engines hold the base (not ``whole``) only what trains; the merged
        weights otherwise (the probe's reference model takes them too)."""
        if not self.plan.adapters or reference:
            return SyncPart()
        if whole:
            return SyncPart(adapters=True)
        from moe_rl.megatron.lora import trains

        return SyncPart(adapters=True, only=trains(self.model, self.lora))

    @functools.cached_property
    def owns_any(self) -> bool:
        """Whether this rank sends any tensor (`sends`)."""
        return any(sends(name) for name, _ in self.model.named_parameters())

    def release(self) -> None:
        """Device memory kept between syncs given back, for a colocated generation (`Transport.release`)."""
        for transport in self.transports.values():
            transport.release()

    def close(self) -> None:
        """Remove this rank's shared slots and arena file (before the process ends)."""
        for transport in self.transports.values():
            transport.close()
        if self.arena is not None:
            self.arena.close()
        self.transports, self.arena = {}, None


def sync_in_process(
    receiver: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig, num_layers: int,
    version: int, quantized_wire: bool = True, capacity: int = 64 << 20,
) -> SyncReport:  # fmt: skip
    """A whole sync of ``named_tensors`` (HF names) into a `protocol.WeightReceiver` in this process, through
    what a trainer rank uses: the recipe's encoder, buckets, a transport, the protocol."""
    encoder = WireEncoder(quant, num_layers, quantized_wire=quantized_wire)
    outgoing = Outgoing(lambda: ([item] for item in named_tensors), encoder)
    receiver.begin_weight_update(version)
    out = InProcess(capacity).send(outgoing, {0: Receiver(receiver.receive_bucket)}, 0.0)
    received = receiver.finish_weight_update(version)
    return SyncReport(
        version, bytes=out.bytes, in_place=out.in_place, buckets=out.buckets, senders=1, shared_memory=False,
        quant=encoder.report if encoder.active else None, received=received,
    )  # fmt: skip
