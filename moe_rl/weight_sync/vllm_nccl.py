"""Weights from the trainer's GPUs straight into vLLM engines on other nodes, through vLLM's own
NCCL weight-transfer backend (``weight_transfer_config={"backend": "nccl"}``).

vLLM's dense NCCL backend has one sender: NCCL rank 0 of a group that holds it and the engines'
workers. Its trainer side, vLLM's ``NCCLTrainerWeightTransferEngine``, is used as it is, fed by:

* `TrainerSource`, vLLM's ``WeightSource`` over the trainer's Megatron model: the Hugging Face-
  named tensors in the engine's dtype (`engine_dtype`), tensor-parallel shards gathered, and, with
  expert parallelism, each expert gathered from the expert-parallel rank that holds it to trainer
  rank 0, which sends everything. Every rank iterates it together (the gathers are collectives);
  its ``metadata()`` is learnt by one pass at the first sync and kept.
* `EngineFanOut`, vLLM's ``VLLMWeightSyncClient`` over every engine of the sync at once: each
  engine's workers join the one group at their own rank offset, so one broadcast reaches them all.
  Each of vLLM's control-plane calls travels to an engine as a `TransferCall`, which the engine
  process hands to vLLM (`moe_rl.rollout.vllm_engine.VLLMEngine.transfer`).

`VLLMNccl` is the transport a sending rank holds (`moe_rl.weight_sync.transport`): it opens the
group at the first sync and again when the engines change, and runs vLLM's round trip
(``start_weight_update``, ``update_weights`` concurrent with the broadcast, ``finish_weight_update``).
The engine takes the policy version when the sync's coordinator finishes it, as with buckets.

The bytes travel only on CUDA: the data plane is NCCL. On CPU the configuration, the metadata and
the tensors' order are checked against vLLM's own classes (``tests/unit/rollout``).
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
        """Each engine's init info: vLLM's, with the engine's workers placed after those of the
        engines before it (vLLM places one engine's workers at ``rank_offset`` and on)."""
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

    Trainer rank 0 yields every tensor of the model; the others yield nothing but take part in the
    gathers. Needs one pipeline stage (vLLM's NCCL backend has one sender). Built by `source`, which
    makes it a subclass of vLLM's ``WeightSource``."""

    def __init__(
        self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str,
        select: Callable[[str], bool] | None = None,
    ):  # fmt: skip
        """``select(megatron_name)``: whether this rank sends the tensor (`moe_rl.weight_sync.sender.
        sends`; every rank by default)."""
        self.model, self.dtype, self.device, self.select = model, dtype, torch.device(device), select
        self._metadata: list | None = None
        self.bytes = 0
        """Bytes the last pass yielded."""

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        if self._metadata is None:  # one pass, on every rank (collective), at the first sync
            self._metadata = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from moe_rl.megatron.hf_weights import iter_hf_weight_groups

        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("vLLM's NCCL weight transfer has one sender: it needs one pipeline stage")
        ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        group = ps.get_expert_model_parallel_group() if ep > 1 else None
        local = _num_experts(self.model) // ep
        root = not dist.is_initialized() or dist.get_rank() == 0
        self.bytes = 0
        for _, pieces in iter_hf_weight_groups(self.model, select=self.select, copy=False):
            for name, piece in pieces:
                piece = engine_dtype(name, piece, self.dtype).to(self.device)
                if ep > 1 and _EXPERT.search(name):  # every expert-parallel rank holds its own experts
                    parts = [torch.empty_like(piece) for _ in range(ep)]
                    dist.all_gather(parts, piece.contiguous(), group=group)
                    named = [(_peer_expert(name, rank, local), part) for rank, part in enumerate(parts)]
                else:
                    named = [(name, piece)]
                if root:
                    for item in named:
                        self.bytes += item[1].numel() * item[1].element_size()
                        yield item


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
    select: Callable[[str], bool] | None = None,
) -> Any:  # fmt: skip
    """A `TrainerSource` that is a vLLM ``WeightSource`` (vLLM is imported here, not at import)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    cls = type("VLLMTrainerSource", (TrainerSource, WeightSource), {})
    return cls(model, dtype, device, select)


class VLLMNccl(Transport):
    """vLLM's NCCL weight transfer from this trainer rank to vLLM engines (see the module
    docstring). The group is opened at the first sync and kept while the engines are the same
    processes (``members``)."""

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
