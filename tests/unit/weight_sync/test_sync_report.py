"""The sync's typed report and the sender's transports: what every run logs as ``sync/*`` and
``quant/*`` is named in one place, totals over the sending ranks; one transport per route of the
run's sync plan, kept from sync to sync."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.config.modes import SyncRoute
from moe_rl.config.schema import QuantConfig
from moe_rl.quant.recipes import QuantReport
from moe_rl.weight_sync.report import SyncReport
from moe_rl.weight_sync.sender import RankSender
from moe_rl.weight_sync.transport import DeviceIpc, HostBuckets, InProcess, ProcessGroup, SharedMemory

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def _quant(num: int) -> QuantReport:
    report = QuantReport("fp8_block128")
    for i in range(num):
        w = torch.full((4, 4), float(i + 1))
        report.add_quantized(f"w{i}", w, err_sq=1.0, ref_sq=float(w.pow(2).sum()), bits=8)
    return report


def test_the_report_totals_the_senders_and_names_the_metrics_once():
    total = SyncReport(version=3)
    total.merge(SyncReport(bytes=100, in_place=40, buckets=2, senders=1, shared_memory=True, quant=_quant(2)))
    total.merge(SyncReport(bytes=0, buckets=0, senders=1, shared_memory=False))  # owns nothing: not a sender
    total.merge(SyncReport(bytes=50, buckets=1, senders=1, shared_memory=True, quant=_quant(1), dead={1}))
    total.received = {"bytes_loaded": 150.0, "quant/recipe": "fp8_block128", "note": [1]}
    total.seconds = 0.5
    metrics = total.metrics()
    assert (
        metrics["sync/bytes"] == 150 and metrics["sync/in_place_bytes"] == 40 and metrics["sync/buckets"] == 3
    )
    assert (
        metrics["sync/senders"] == 2 and metrics["sync/shared_memory"] == 1 and metrics["sync/seconds"] == 0.5
    )
    assert metrics["sync/bytes_loaded"] == 150.0  # a receiver's own number, under sync/
    assert metrics["quant/num_quantized"] == 3 and metrics["quant/recipe"] == "fp8_block128"
    assert "sync/note" not in metrics  # only numbers and names are logged
    assert total.dead == {1}


def test_one_sender_without_shared_memory_makes_the_sync_not_shared():
    total = SyncReport().merge(SyncReport(bytes=8, buckets=1, senders=1, shared_memory=True))
    total.merge(SyncReport(bytes=8, buckets=1, senders=1, shared_memory=False))
    assert total.metrics()["sync/shared_memory"] == 0


def test_the_sender_keeps_one_transport_per_route_and_buckets_go_by_where_the_receivers_are():
    from moe_rl.config import load_recipe
    from moe_rl.config.sync_plan import sync_plan
    from moe_rl.weight_sync.vllm_transfer import VLLMIpc, VLLMNccl

    plan = sync_plan(load_recipe(TINY), "cpu")
    sender = RankSender(torch.nn.Linear(4, 4), QuantConfig(), 1, plan, host="10.0.0.7")
    kinds = {
        SyncRoute.BUCKETS: HostBuckets, SyncRoute.IN_PROCESS: InProcess, SyncRoute.DEVICE_IPC: DeviceIpc,
        SyncRoute.VLLM_NCCL: VLLMNccl, SyncRoute.VLLM_IPC: VLLMIpc,
    }  # fmt: skip
    try:
        for route, kind in kinds.items():
            transport = sender._transport(route)
            assert type(transport) is kind and transport.capacity == plan.bucket_bytes
            assert sender._transport(route) is transport  # kept from sync to sync
        buckets = sender._transport(SyncRoute.BUCKETS)
        ways = {"near": SharedMemory, "far": ProcessGroup, "both": SharedMemory}
        for way, kind in ways.items():
            assert isinstance(buckets._way(way), kind) and list(buckets._ways) == [way]  # the others closed
        assert buckets._way("both").far.host == "10.0.0.7"  # the store other nodes reach
        assert sender._transport(SyncRoute.VLLM_NCCL).host == "10.0.0.7"
    finally:
        sender.close()
    shared = SharedMemory(1024)
    try:
        assert shared.shared_memory and shared.packer.slots is not None and shared.packer is shared.packer
    finally:
        shared.close()
    assert not InProcess(1024).shared_memory and InProcess(1024).packer.slots is None
