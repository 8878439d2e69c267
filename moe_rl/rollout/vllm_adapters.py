"""A LoRA run's adapters sent apart from the base (``lora.sync=adapters``) into a vLLM engine,
loaded through vLLM's own LoRA (`VllmAdapters`). Imports vLLM only when adapters load."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from moe_rl.config.schema import LoraConfig
from moe_rl.quant.recipes import ADAPTER_HF


class VllmAdapters:
    """LoRA adapters sent apart from the base (``lora.sync=adapters``), loaded through vLLM's own LoRA.

    A sync's adapter tensors (HF names ending ``.lora_A.weight`` / ``.lora_B.weight``) are kept
    aside from its buckets (`take`); when it finishes (`load`) they are written as a PEFT adapter
    folder (`moe_rl.megatron.peft_adapter`) in host shared memory and handed to vLLM as one
    ``LoRARequest`` (``load_inplace``: the same adapter id, reloaded), which vLLM's LoRA manager
    reads, checks against the model's LoRA modules and keeps in host memory; every later request
    names it (`request`) and vLLM copies it into its LoRA layers. vLLM has read the folder when
    ``add_lora`` returns, so it is removed then (the engine holds one adapter, which vLLM's cache of
    ``max_loras`` = 1 never evicts). The first sync, and the one after the engine restarts, brings
    the base too (`holds_base` after it)."""

    ADAPTER_ID = 1

    def __init__(self, lora: LoraConfig, base: str) -> None:
        self.lora, self.base = lora, base
        self.request: Any = None
        """The ``LoRARequest`` generation passes; None until the first sync brought adapters."""
        self.holds_base = False
        self._tensors: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        self._tensors = {}

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base tensors of ``named``; the adapters are kept (copied: the bucket is reused)."""

        for name, tensor in named:
            if name.endswith(ADAPTER_HF):
                if name in self._tensors:
                    raise ValueError(f"weight {name!r} arrived twice in one sync")
                self._tensors[name] = tensor.detach().to("cpu", copy=True)
            else:
                yield name, tensor

    def load(self, llm: Any, version: int) -> dict[str, float]:
        """Hand this sync's adapters to vLLM; a sync must bring them (it is one of a LoRA run)."""
        from vllm.lora.request import LoRARequest

        from moe_rl.megatron.peft_adapter import peft_tensors, write_adapter

        if not self._tensors:
            raise ValueError("weight sync incomplete: a sync into an engine with LoRA adapters brought none")
        start = time.perf_counter()
        tensors = peft_tensors(self._tensors.items())
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="moe_rl_lora_", dir=folder) as path:
            write_adapter(tensors, self.lora, path, self.base)
            name = f"policy_v{version}"
            if not llm.llm_engine.add_lora(LoRARequest(name, self.ADAPTER_ID, path, load_inplace=True)):
                raise RuntimeError(f"vLLM did not load the adapters of weights v{version}")
        # generation names the loaded adapter (not in place: vLLM would read the folder again)
        self.request = LoRARequest(name, self.ADAPTER_ID, path)
        self.holds_base, self._tensors = True, {}
        return {
            "adapters_load_s": time.perf_counter() - start,
            "adapters_bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
        }
