"""Run by test_vllm_cuda_contract.py in a process of its own (vLLM builds its own distributed
state): the weights the CUDA vLLM engine is sent, described by the weight-transfer metadata it
hands vLLM, load into vLLM's own model class, built on CPU.

    python tests/unit/rollout/vllm_load_check.py RECIPE   # prints one JSON line

1. The trainer's Megatron model of the recipe (its CPU twin's shape) exports HF-named tensors
   (`iter_hf_weights`), in the engine's dtype (bf16, as on CUDA; `_to_engine_dtype`, which keeps
   the weights vLLM holds in float32 in float32).
2. The trainer's source for vLLM's NCCL transfer (`moe_rl.weight_sync.vllm_transfer.source`, a vLLM
   ``WeightSource``) describes them (`ParamMeta`) and yields them, checked against its own metadata
   by vLLM's trainer engine (``_checked_iter``); vLLM's NCCL update info is built from that the way
   vLLM's trainer engine builds it (its dataclass checks itself). The source the engine's process
   hands vLLM's IPC transfer (`_TensorListSource`) describes the same tensors.
3. vLLM's model class for the recipe's `config.json` is built on CPU, the tensors are materialized
   from the update info as vLLM's receiving side does (`getattr(torch, dtype_name)`, the shape)
   and loaded with the model's own `load_weights` (which checks every shape): every parameter of
   the model must be loaded, and nothing else.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch


def main(recipe: str) -> dict:
    from moe_rl.device import Machine
    from moe_rl.megatron.hf_weights import iter_hf_weights
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.rollout.megatron_engine import WHOLE_MODEL
    from moe_rl.rollout.vllm_engine import _TensorListSource, _to_engine_dtype, engine_config, llm_kwargs
    from moe_rl.weight_sync import vllm_transfer

    config = load_checked(recipe, ["run.device=cpu", "rollout.engine=megatron"], Machine(cuda=False))
    init_parallel(WHOLE_MODEL)
    model = build_gpt_model(config.model, WHOLE_MODEL, config.trainer, seed=0)
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    source = vllm_transfer.source(model, torch.bfloat16, "cpu")
    meta = source.metadata()
    values = {name: t.clone() for name, t in NCCLTrainerWeightTransferEngine._checked_iter(source, meta)}
    ipc = _TensorListSource()
    ipc.tensors = list(_to_engine_dtype(iter_hf_weights(model), torch.bfloat16))
    if ipc.metadata() != meta:
        raise AssertionError("the IPC and NCCL sources describe different tensors")
    torch.distributed.destroy_process_group()  # vLLM builds its own

    update = NCCLWeightTransferUpdateInfo(
        names=[m.name for m in meta],
        dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
        shapes=[list(m.shape) for m in meta],
    )
    update = NCCLWeightTransferUpdateInfo(**asdict(update))  # as the workers receive it

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(model_config_to_hf_config(config.model, dtype="bfloat16")))
    torch.cpu._is_amx_tile_supported = lambda: True  # MLA keeps its GPU-platform settings
    vllm_config = engine_config(llm_kwargs(folder, device="cpu", dtype="bfloat16", max_model_len=64))
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(vllm_config.model_config.dtype):  # as vLLM's loader builds it
            vmodel = initialize_model(vllm_config)
    received = []
    for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
        tensor.copy_(values[name])
        received.append((name, tensor))
    loaded = vmodel.load_weights(iter(received))
    params = {name: p for name, p in vmodel.named_parameters()}
    return {
        "model_class": type(vmodel).__name__,
        "sent": len(received),
        "params": len(params),
        "missing": sorted(set(params) - set(loaded)),
        "unknown": sorted(set(loaded) - set(params)),
        "dtypes": {name: str(p.dtype).split(".")[-1] for name, p in params.items()},
        "wire_dtypes": dict(zip(update.names, update.dtype_names, strict=True)),
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1])) + "\n")
