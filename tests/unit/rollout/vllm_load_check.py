"""Run by test_vllm_cuda_contract.py in a process of its own (vLLM builds its own distributed
state): the weights the CUDA vLLM engine is sent, described by the weight-transfer metadata it
hands vLLM, load into vLLM's own model class, built on CPU.

    python tests/unit/rollout/vllm_load_check.py RECIPE [QUANT ...]   # prints one JSON line

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
   the model must be loaded, and nothing else. Each parameter's loader records the tensors it is
   handed, so every tensor sent is matched to the parameter it lands in, fused ones included
   (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, every expert into ``w13``/``w2``).
4. For each quantization recipe ``QUANT``: the buckets a trainer rank streams to the engine (the
   recipe's `WireEncoder` as the sync plan of a CUDA vLLM engine sets it), decoded as the engine
   decodes them; and, for every linear and expert layer of vLLM's model, the method vLLM's own
   quantization config of the recipe (the engine's ``quantization``) resolves for it.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

BUCKETS_TO_VLLM = ["rollout.engine=vllm", "rollout.sync_transport=buckets"]
"""A vLLM engine that takes the trainer's buckets (the route of a trainer with several pipeline
stages)."""


def main(recipe: str, quants: list[str]) -> dict:
    from moe_rl.config.loader import load_recipe
    from moe_rl.device import Machine
    from moe_rl.megatron.hf_weights import iter_hf_weights
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.rollout.engine import WHOLE_MODEL
    from moe_rl.rollout.vllm_receiver import _TensorListSource, _to_engine_dtype
    from moe_rl.rollout.vllm_settings import VllmSettings, engine_config, llm_kwargs
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
    trainer = {name: _described(t) for name, t in iter_hf_weights(model)}
    streamed = {
        quant: _streamed(model, load_recipe(recipe, [f"rollout.quant={quant}", *BUCKETS_TO_VLLM]))
        for quant in quants
    }
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
    vllm_config = engine_config(
        llm_kwargs(folder, VllmSettings(device="cpu", dtype="bfloat16", max_model_len=64))
    )
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
    landed = _record_loads(vmodel, received)
    loaded = vmodel.load_weights(iter(received))
    params = {name: p for name, p in vmodel.named_parameters()}
    by_quant = {}
    for quant in quants:
        cfg = load_recipe(recipe, [f"rollout.quant={quant}"]).quant
        quantization = llm_kwargs(folder, VllmSettings(quant=cfg, device="cuda")).get("quantization")
        kwargs = llm_kwargs(folder, VllmSettings(device="cpu", dtype="bfloat16", max_model_len=64))
        quant_config = engine_config({**kwargs, "quantization": quantization}).quant_config
        by_quant[quant] = {
            "quantization": quantization, "methods": _methods(vmodel, quant_config), "streamed": streamed[quant],
        }  # fmt: skip
    return {
        "model_class": type(vmodel).__name__,
        "sent": len(received),
        "params": len(params),
        "missing": sorted(set(params) - set(loaded)),
        "unknown": sorted(set(loaded) - set(params)),
        "dtypes": {name: str(p.dtype).split(".")[-1] for name, p in params.items()},
        "wire_dtypes": dict(zip(update.names, update.dtype_names, strict=True)),
        "landed": landed,
        "held_by_trainer": trainer,
        "by_quant": by_quant,
    }


def _described(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).split(".")[-1], list(tensor.shape)]


def _streamed(model: torch.nn.Module, config) -> dict[str, dict]:
    """What a trainer rank's buckets for a CUDA vLLM engine of ``config`` carry (the ``buckets`` route
    of its sync plan: ``travelled``, name -> dtype of every entry) and what the engine decodes from
    them (`moe_rl.rollout.vllm_receiver.VllmReceiver.bucket`; ``decoded``: name -> [dtype, shape])."""
    from moe_rl.config.sync_plan import sync_plan
    from moe_rl.weight_sync.buckets import BucketPacker
    from moe_rl.weight_sync.outgoing import Outgoing, owned
    from moe_rl.weight_sync.receiver import decoded
    from moe_rl.weight_sync.wire import Rejoin, WireEncoder

    plan = sync_plan(config, "cuda")
    encoder = WireEncoder(config.quant, model.config.num_layers, quantized_wire=plan.quantized_wire)
    outgoing = Outgoing(lambda: owned(model), encoder)
    rejoin, travelled, out = Rejoin(), {}, {}
    for bucket in BucketPacker(1 << 20).pack(outgoing.groups(1 << 20)):
        travelled.update((entry.name, entry.dtype) for entry in bucket.entries)
        out.update((name, _described(tensor)) for name, tensor in decoded(bucket, rejoin=rejoin))
    rejoin.finish()
    return {"travelled": travelled, "decoded": out}


def _record_loads(vmodel: torch.nn.Module, received: list[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """Wraps the loader of every parameter of ``vmodel`` so that each tensor of ``received`` (known by
    its storage) names the parameters it is loaded into, with their dtypes: sent name -> [[param,
    dtype], ...], filled as `load_weights` runs."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    sent = {tensor.untyped_storage().data_ptr(): name for name, tensor in received}
    landed: dict[str, list] = {}

    def recording(load, param_name: str):
        def recorded(*args, **kwargs):  # vLLM's loaders take (param, loaded_weight, ...), by position or name
            done = load(*args, **kwargs)
            if done is not False:  # an expert loader says whether the expert is this rank's
                param = args[0] if args else kwargs["param"]
                loaded = args[1] if len(args) > 1 else kwargs["loaded_weight"]
                name = sent.get(loaded.untyped_storage().data_ptr(), "<not a tensor sent>")
                landed.setdefault(name, []).append([param_name, str(param.dtype).split(".")[-1]])
            return done

        return recorded

    for param_name, param in vmodel.named_parameters():
        param.weight_loader = recording(getattr(param, "weight_loader", default_weight_loader), param_name)
    return landed


def _methods(vmodel: torch.nn.Module, quant_config) -> dict[str, str]:
    """For each linear and expert layer of ``vmodel``: the class of the method ``quant_config``
    (vLLM's, of a recipe's online quantization) resolves for it, ``online`` for a method that loads
    the full-precision weight in the model's dtype and quantizes it after loading, ``none`` for no
    quantization."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase
    from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase

    if not isinstance(quant_config, OnlineQuantizationConfig):
        return {"*": type(quant_config).__name__}
    out = {}
    for prefix, module in vmodel.named_modules():
        if not isinstance(module, (LinearBase, RoutedExperts)):
            continue
        resolved = quant_config.resolve_quant_method_cls(type(module), prefix)
        method = resolved[-1] if resolved is not None else None
        if method is None:
            out[prefix] = "none"
        elif issubclass(method, (OnlineLinearBase, OnlineMoEMethodBase)) and method.uses_meta_device:
            out[prefix] = "online"
        else:
            out[prefix] = method.__name__
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1], sys.argv[2:])) + "\n")
