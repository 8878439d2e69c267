"""Weights from the trainer's GPUs straight into vLLM engines by vLLM's own weight-transfer backends, their
trainer sides as vLLM ships them (`VLLMNccl`, `VLLMIpc`), over the model as `TrainerSource` and the engines as
`EngineFanOut`, whose calls an engine takes as messages of the sync (`moe_rl.weight_sync.protocol.TransferCall`). The bytes travel only on
CUDA; on CPU the configuration, infos, metadata and tensor order are checked against vLLM's classes.
"""

from __future__ import annotations

import socket
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.weight_sync.outgoing import Outgoing, sends, whole_model
from moe_rl.weight_sync.protocol import (
    TransferCall,
    TransferFinish,
    TransferInit,
    TransferStart,
    TransferUpdate,
)
from moe_rl.weight_sync.transport import Published, Receivers, Transport, settle


class EngineLost(RuntimeError):
    """Engines' processes died during a vLLM weight transfer (``dead``: their indices)."""

    def __init__(self, dead: set[int], method: str):
        super().__init__(f"engines {sorted(dead)} died during vLLM's {method}")
        self.dead = dead


class EngineFanOut:
    """vLLM's ``VLLMWeightSyncClient`` over several engines: each call goes to every engine at once
    (``receivers``: `transport.Receiver.deliver` by index) and returns when all have answered;
    ``workers``: each engine's vLLM workers, placed one engine after another in a group (NCCL)."""

    def __init__(
        self,
        receivers: dict[int, Callable[[TransferCall], Any]],
        workers: dict[int, int],
        timeout_s: float,
    ):
        self.receivers, self.workers, self.timeout_s = receivers, workers, timeout_s
        self.order = sorted(receivers)

    @property
    def world_size(self) -> int:
        """The group: the sender and every worker of every engine."""
        return 1 + sum(self.workers[i] for i in self.order)

    def init_payloads(self, init_info: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Each engine's init info: vLLM's, in a group (NCCL) with the engine's workers (vLLM's
        ``rank_offset``) after those of the engines before it."""
        if "rank_offset" not in init_info:  # no group to place workers in (IPC)
            return {i: dict(init_info) for i in self.order}
        if init_info["world_size"] != self.world_size:
            raise ValueError(
                f"world_size={init_info['world_size']} but the sender and the engines' workers are {self.world_size}"
            )
        payloads, offset = {}, int(init_info["rank_offset"])
        for i in self.order:
            payloads[i] = {**init_info, "rank_offset": offset}
            offset += self.workers[i]
        return payloads

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payloads = self.init_payloads(init_info)
        self._call({i: TransferInit(payloads[i]) for i in self.order})

    def start_weight_update(self) -> None:
        self._call(dict.fromkeys(self.order, TransferStart()))

    def update_weights(self, update_info: Any) -> None:
        self._call(dict.fromkeys(self.order, TransferUpdate(update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM's part ends; ``weight_version`` is not handed on: each engine takes the sync's version
        when the sync finishes."""
        self._call(dict.fromkeys(self.order, TransferFinish()))

    def _call(self, calls: dict[int, TransferCall]) -> None:
        dead = settle([(i, self.receivers[i](call)) for i, call in calls.items()], self.timeout_s)
        if dead:
            raise EngineLost(dead, next(iter(calls.values())).method)


class TrainerSource:
    """vLLM's ``WeightSource`` (made one by `source`): `outgoing.whole_model` in the engines' ``dtype``,
    yielded by trainer rank 0 (``every_rank``: by every rank); its metadata learnt by the first pass."""

    def __init__(
        self, model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device | str,
        select: Callable[[str], bool] | None = None, every_rank: bool = False,
    ):  # fmt: skip
        """``select``: the tensors this rank takes part for; ``dtype``: what they are cast to (None: kept)."""
        self.model, self.dtype, self.device, self.select = model, dtype, torch.device(device), select
        self.every_rank, self._metadata = every_rank, None
        self.bytes = 0
        """Bytes the last pass yielded."""

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        if self._metadata is None:  # one pass, on every rank (collective), at the first sync
            self._metadata = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        root = self.every_rank or not dist.is_initialized() or dist.get_rank() == 0
        self.bytes = 0
        for named in whole_model(self.model, self.dtype, self.device, self.select, root):
            self.bytes += sum(t.numel() * t.element_size() for _, t in named)
            yield from named

    def join_gathers(self) -> None:
        """A rank that yields nothing takes part in the gathers of one pass."""
        for _ in self:
            pass


def source(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str,
    select: Callable[[str], bool] | None = None, every_rank: bool = False,
) -> Any:  # fmt: skip
    """A `TrainerSource` that is a vLLM ``WeightSource`` (vLLM is imported here, not at import)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    cls = type("VLLMTrainerSource", (TrainerSource, WeightSource), {})
    return cls(model, dtype, device, select, every_rank)


class VLLMTransfer(Transport):
    """vLLM's trainer-side weight transfer over the whole model: the source is made at the first
    sync and kept, vLLM's trainer engine again when the engines are other processes (`Receiver.key`)."""

    every_rank = False
    """Every rank yields the whole model (else rank 0 alone: `TrainerSource`)."""
    workers = 1

    def __init__(self, capacity: int, sender: int = 0):
        super().__init__(capacity, sender)
        self.engine, self.members, self.source = None, (), None

    @abstractmethod
    def _start(self, client: EngineFanOut, weights: Any) -> Any:
        """vLLM's trainer engine of this backend over ``client`` and ``weights``."""

    def send(self, outgoing: Outgoing, receivers: Receivers, timeout_s: float) -> Published:
        """Send the whole model to rank 0's engines; the other ranks join the gathers (or share theirs)."""
        if self.source is None:
            model = outgoing.model
            select = None if self.every_rank else sends  # IPC: every rank shares the whole model
            device = next(model.parameters()).device
            self.source = source(model, torch.bfloat16, device, select, self.every_rank)
        if not receivers and not self.every_rank:  # (at the first sync also the metadata's pass)
            self.source.metadata()
            self.source.join_gathers()
            return Published()
        members = tuple(receivers[i].key for i in sorted(receivers))
        try:
            if self.engine is None or members != self.members:
                self.close()
                client = EngineFanOut(
                    {i: r.deliver for i, r in receivers.items()}, dict.fromkeys(receivers, self.workers),
                    timeout_s,
                )  # fmt: skip
                self.engine = self._start(client, self.source)
                self.members = members
            self.engine.send_weights()
        except EngineLost as e:
            self.close()  # the group is broken; the next sync opens a new one with the live engines
            return Published(dead=e.dead)
        if not receivers:  # it shared its GPU's copy; rank 0 reports the sync
            return Published()
        chunks = -(-self.source.bytes // self.capacity)  # vLLM's packed buffers, filled one after another
        return Published(bytes=self.source.bytes, buckets=chunks, transports={self.name})

    def close(self) -> None:
        if self.engine is not None:  # (a no-op for vLLM's IPC engine)
            self.engine.shutdown()
        self.engine, self.members = None, ()


class VLLMNccl(VLLMTransfer):
    """vLLM's ``NCCLTrainerWeightTransferEngine``: trainer rank 0 sends the whole model."""

    name = "vllm_nccl"

    def __init__(self, capacity: int, sender: int = 0, host: str | None = None, workers: int = 1):
        """``capacity``: bytes of each of vLLM's packed buffers; ``workers``: each engine's TP size."""
        super().__init__(capacity, sender)
        self.host = host or socket.gethostbyname(socket.gethostname())
        self.workers = workers

    def init_info(self, port: int, world_size: int) -> Any:
        """vLLM's trainer init info of a group of ``world_size`` meeting at ``port``."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            rank=0, master_address=self.host, master_port=port, world_size=world_size, packed=True,
            packed_buffer_size_bytes=self.capacity, packed_num_buffers=2,  # one filled while one is sent
        )  # fmt: skip

    def _start(self, client: EngineFanOut, weights: Any) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        with socket.socket() as s:  # a free port for vLLM's group store (vLLM binds it itself)
            s.bind(("", 0))
            port = s.getsockname()[1]
        init = self.init_info(port, client.world_size)
        return NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=weights)


class VLLMIpc(VLLMTransfer):
    """vLLM's ``IPCTrainerWeightTransferEngine``: every rank shares the whole model on its GPU by IPC
    handle; rank 0 drives the engines, whose workers map their own GPU's buffer (no host memory)."""

    name = "vllm_ipc"
    every_rank = True

    def init_info(self) -> Any:
        """vLLM's trainer init info of this rank (``capacity``: bytes of its packed IPC buffer)."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=self.sender, packed=True, packed_buffer_size_bytes=self.capacity)

    def _start(self, client: EngineFanOut, weights: Any) -> Any:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

        return IPCTrainerWeightTransferEngine.trainer_init(self.init_info(), client=client, source=weights)
