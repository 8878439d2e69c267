"""Weights from the trainer's GPUs straight into vLLM engines, through vLLM's own weight-transfer
backends, their trainer sides used as vLLM ships them:

* NCCL (`VLLMNccl`; engines on nodes of their own): vLLM's ``NCCLTrainerWeightTransferEngine``. The
  backend has one sender, NCCL rank 0 of a group that holds it and every worker of every engine of
  the sync; trainer rank 0 sends the whole model.
* CUDA IPC (`VLLMIpc`; engines colocated on the trainer's GPUs): vLLM's
  ``IPCTrainerWeightTransferEngine``. Every trainer rank materializes the whole model on its GPU in
  vLLM's packed buffers and shares them by IPC handle; rank 0 merges the handles of every GPU and
  hands them to the engines, whose workers map the buffer of their own GPU. Nothing goes through
  host memory.

Both are fed by:

* `TrainerSource`, vLLM's ``WeightSource`` over the trainer's Megatron model: the Hugging Face-
  named tensors in the engine's dtype (`engine_dtype`), tensor-parallel shards gathered, and, with
  expert parallelism, each expert all-gathered over the expert-parallel group as it is sent. Rank 0
  yields every tensor (NCCL), or every rank does (IPC). Every rank iterates it together (the
  gathers are collectives); its ``metadata()`` is learnt by one pass at the first sync and kept.
  Both need one pipeline stage (every sending rank sees the whole model).
* `EngineFanOut`, vLLM's ``VLLMWeightSyncClient`` over every engine of the sync at once (NCCL: each
  engine's workers at their own rank offset in the one group). Each of vLLM's control-plane calls
  travels to an engine as a `TransferCall`, which the engine process hands to vLLM
  (`moe_rl.rollout.vllm_engine.VLLMEngine.transfer`).

The transport runs vLLM's round trip (``start_weight_update``, ``update_weights``,
``finish_weight_update``); the engine takes the policy version when the sync's coordinator finishes
it, as with buckets. The bytes travel only on CUDA; on CPU the configuration, the init and update
infos, the metadata and the tensors' order are checked against vLLM's own classes
(``tests/unit/rollout``, ``tests/distributed``).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.weight_sync.transport import Published, Reach, Transport, settle

FLOAT32_WEIGHTS = ("e_score_correction_bias",)
"""Weights vLLM's models hold in float32 whatever the engine's dtype (DeepSeek-V3's expert-score
correction bias, which decides the routing): they travel in float32, not rounded to the engine's
dtype (the contract test against vLLM's model class checks every weight's dtype)."""

BUFFERS = 2
"""Packed buffers vLLM's broadcast holds on each side (one filled while one is sent)."""


def engine_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the dtype a vLLM engine of ``dtype`` holds weight ``name`` in."""
    if tensor.is_floating_point():
        return tensor.to(torch.float32 if name.endswith(FLOAT32_WEIGHTS) else dtype)
    return tensor


@dataclass(frozen=True)
class TransferCall:
    """One of vLLM's weight-transfer control-plane calls, as an engine process is handed it:
    ``method`` is ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` or
    ``finish_weight_update``; ``payload`` its argument (the init or update info, as a dict)."""

    method: str
    payload: Any = None

    METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"TransferCall.method={self.method!r}: not one of {self.METHODS}")


class EngineLost(RuntimeError):
    """Engines' processes died during a vLLM weight transfer (``dead``: their indices)."""

    def __init__(self, dead: set[int], method: str):
        super().__init__(f"engines {sorted(dead)} died during vLLM's {method}")
        self.dead = dead


class EngineFanOut:
    """vLLM's ``VLLMWeightSyncClient`` over several engines (see the module docstring).

    ``receivers`` maps an engine's index to a function that hands it a `TransferCall` (a Ray call
    returning an object reference, or a call in this process returning its result); ``workers``
    gives each engine's number of vLLM workers (its tensor-parallel size). Each call goes to every
    engine at once and returns when all have answered."""

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
        """Each engine's init info: vLLM's; for a group (NCCL), with the engine's workers placed
        after those of the engines before it (vLLM places one engine's workers at ``rank_offset``
        and on)."""
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
        self._call({i: TransferCall("init_weight_transfer_engine", payloads[i]) for i in self.order})

    def start_weight_update(self) -> None:
        self._call({i: TransferCall("start_weight_update") for i in self.order})

    def update_weights(self, update_info: Any) -> None:
        self._call({i: TransferCall("update_weights", update_info) for i in self.order})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call({i: TransferCall("finish_weight_update", weight_version) for i in self.order})

    def _call(self, calls: dict[int, TransferCall]) -> None:
        dead = settle([(i, self.receivers[i](call)) for i, call in calls.items()], self.timeout_s)
        if dead:
            raise EngineLost(dead, next(iter(calls.values())).method)


_EXPERT = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")


class TrainerSource:
    """vLLM's ``WeightSource`` over a trainer rank's Megatron model (see the module docstring).

    Trainer rank 0 yields every tensor of the model, and the others nothing but take part in the
    gathers; with ``every_rank`` each rank yields every tensor. Needs one pipeline stage. Built by
    `source`, which makes it a subclass of vLLM's ``WeightSource``."""

    def __init__(
        self, model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device | str,
        select: Callable[[str], bool] | None = None, every_rank: bool = False,
    ):  # fmt: skip
        """``select(megatron_name)``: whether this rank sends the tensor (`moe_rl.weight_sync.sender.
        sends`; every rank by default). ``dtype``: what the tensors are cast to (vLLM's), None: kept."""
        self.model, self.dtype, self.device, self.select = model, dtype, torch.device(device), select
        self.every_rank = every_rank
        self._metadata: list | None = None
        self.bytes = 0
        """Bytes the last pass yielded."""

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        if self._metadata is None:  # one pass, on every rank (collective), at the first sync
            self._metadata = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self.groups():
            yield from group

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The tensors by Megatron tensor: all the HF pieces of one (of one expert each, for the
        experts of every expert-parallel rank) in a list. ``dtype`` None keeps the trainer's."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from moe_rl.megatron.hf_weights import iter_hf_weight_groups

        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("sending the whole model from a rank needs one pipeline stage")
        ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        group = ps.get_expert_model_parallel_group() if ep > 1 else None
        local = _num_experts(self.model) // ep
        root = self.every_rank or not dist.is_initialized() or dist.get_rank() == 0
        self.bytes = 0
        for _, pieces in iter_hf_weight_groups(self.model, select=self.select, copy=False):
            peers: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for name, piece in pieces:
                if self.dtype is not None:
                    piece = engine_dtype(name, piece, self.dtype)
                piece = piece.to(self.device)
                if ep > 1 and _EXPERT.search(name):  # every expert-parallel rank holds its own experts
                    parts = [torch.empty_like(piece) for _ in range(ep)]
                    dist.all_gather(parts, piece.contiguous(), group=group)
                    for rank, part in enumerate(parts):
                        peers.setdefault(rank, []).append((_peer_expert(name, rank, local), part))
                else:
                    peers.setdefault(0, []).append((name, piece))
            if root:
                for named in peers.values():
                    self.bytes += sum(t.numel() * t.element_size() for _, t in named)
                    yield named


def _num_experts(model: torch.nn.Module) -> int:
    while hasattr(model, "module"):  # DDP and precision wrappers
        model = model.module
    return int(getattr(model.config, "num_moe_experts", None) or 1)


def _peer_expert(name: str, rank: int, local: int) -> str:
    """The HF name of the expert that expert-parallel rank ``rank`` holds where this rank holds
    the one of ``name`` (each rank holds ``local`` consecutive experts, rank 0 the first)."""
    match = _EXPERT.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert's weight")
    own = int(match.group(2))
    return f"{name[: match.start(2)]}{own % local + rank * local}{name[match.end(2) :]}"


def source(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str,
    select: Callable[[str], bool] | None = None, every_rank: bool = False,
) -> Any:  # fmt: skip
    """A `TrainerSource` that is a vLLM ``WeightSource`` (vLLM is imported here, not at import)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    cls = type("VLLMTrainerSource", (TrainerSource, WeightSource), {})
    return cls(model, dtype, device, select, every_rank)


class VLLMNccl(Transport):
    """vLLM's NCCL weight transfer from trainer rank 0 to vLLM engines on other nodes (see the
    module docstring). The group is opened at the first sync and kept while the engines are the same
    processes (``members``)."""

    every_rank = False
    """Only rank 0 yields the tensors (`TrainerSource`)."""

    reach = Reach.OTHER_NODES
    name = "vllm_nccl"

    def __init__(self, capacity: int, sender: int = 0, host: str | None = None, workers: int = 1):
        """``capacity``: bytes of each of vLLM's packed buffers; ``workers``: each engine's vLLM
        workers (its tensor-parallel size)."""
        super().__init__(capacity, sender)
        self.host = host or socket.gethostbyname(socket.gethostname())
        self.workers = workers
        self.engine: Any = None
        self.members: tuple = ()

    def message(self, bucket: Any) -> Any:
        raise NotImplementedError("vLLM's NCCL transfer sends a source's tensors (`send_source`)")

    def init_info(self, port: int, world_size: int) -> Any:
        """vLLM's trainer init info of a group of ``world_size`` meeting at ``port``."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            rank=0, master_address=self.host, master_port=port, world_size=world_size, packed=True,
            packed_buffer_size_bytes=self.capacity, packed_num_buffers=BUFFERS,
        )  # fmt: skip

    def send_source(
        self, weights: Any, receivers: dict[int, Callable[[Any], Any]], timeout_s: float, members: tuple = ()
    ) -> Published:
        """Send every tensor of ``weights`` (a `source`) to the engines ``receivers`` hands calls to."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        members = tuple(members) or tuple(sorted(receivers))
        try:
            if self.engine is None or members != self.members:
                if self.engine is not None:
                    self.engine.shutdown()
                client = EngineFanOut(receivers, dict.fromkeys(receivers, self.workers), timeout_s)
                init = self.init_info(_free_port(), client.world_size)
                self.engine = None
                self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
                    init, client=client, source=weights
                )
                self.members = members
            self.engine.send_weights()
        except EngineLost as e:
            self.close()  # the group is broken; the next sync opens a new one with the live engines
            return Published(dead=e.dead)
        chunks = -(-weights.bytes // self.capacity)  # vLLM's packed buffers, filled one after another
        return Published(bytes=weights.bytes, buckets=chunks, largest=min(weights.bytes, self.capacity))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.members = None, ()
        super().close()


def _free_port() -> int:
    """A free port for vLLM's group store (vLLM binds it itself)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VLLMIpc(Transport):
    """vLLM's CUDA IPC weight transfer from the trainer ranks to vLLM engines on their GPUs (see the
    module docstring). Every rank runs it (it all-gathers the IPC handles over the trainer's group);
    rank 0 drives the engines."""

    reach = Reach.SAME_NODE
    name = "vllm_ipc"
    every_rank = True
    """Every rank yields the whole model on its GPU (`TrainerSource`)."""

    def __init__(self, capacity: int, sender: int = 0):
        """``capacity``: bytes of vLLM's packed IPC buffer (one, reused chunk after chunk)."""
        super().__init__(capacity, sender)
        self.engine: Any = None
        self.members: tuple = ()

    def message(self, bucket: Any) -> Any:
        raise NotImplementedError("vLLM's IPC transfer sends a source's tensors (`send_source`)")

    def init_info(self) -> Any:
        """vLLM's trainer init info of this rank."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=self.sender, packed=True, packed_buffer_size_bytes=self.capacity)

    def send_source(
        self, weights: Any, receivers: dict[int, Callable[[Any], Any]], timeout_s: float, members: tuple = ()
    ) -> Published:
        """Send every tensor of ``weights`` (a `source` of every rank) to the engines ``receivers``
        hands calls to (rank 0's; the other ranks pass none)."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

        members = tuple(members) or tuple(sorted(receivers))
        try:
            if self.engine is None or members != self.members:
                client = EngineFanOut(receivers, dict.fromkeys(receivers, 1), timeout_s)
                self.engine = None
                self.engine = IPCTrainerWeightTransferEngine.trainer_init(
                    self.init_info(), client=client, source=weights
                )
                self.members = members
            self.engine.send_weights()
        except EngineLost as e:
            self.close()
            return Published(dead=e.dead)
        chunks = -(-weights.bytes // self.capacity)
        return Published(bytes=weights.bytes, buckets=chunks, largest=min(weights.bytes, self.capacity))

    def close(self) -> None:
        self.engine, self.members = None, ()
        super().close()
