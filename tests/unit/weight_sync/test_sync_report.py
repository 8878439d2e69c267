"""The sync's typed report and the sender's choice of transport: what every run logs as
``sync/*`` and ``quant/*`` is named in one place, totals over the sending ranks."""

from __future__ import annotations

import torch

from moe_rl.config.schema import QuantConfig
from moe_rl.quant.recipes import QuantReport
from moe_rl.weight_sync.report import SyncReport
from moe_rl.weight_sync.sender import RankSender
from moe_rl.weight_sync.transport import InProcess, Mixed, ProcessGroup, Reach, SharedMemory, Where, reach_of


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


def test_the_sender_picks_its_transport_from_where_the_receivers_are():
    assert reach_of({0: "a", 1: "a"}, "a") == Where(Reach.SAME_NODE, frozenset(), frozenset({0, 1}))
    assert reach_of({0: "b", 1: "c"}, "a") == Where(Reach.OTHER_NODES, frozenset(), frozenset())
    assert reach_of({0: "a", 1: None}, "a") == Where(
        Reach.SAME_NODE, frozenset({1}), frozenset({0})
    )  # dead: left out
    assert reach_of({0: "a", 1: "b", 2: None}, "a") == Where(Reach.MIXED, frozenset({2}), frozenset({0}))
    sender = RankSender(torch.nn.Linear(4, 4), QuantConfig(), num_layers=1, capacity=1024, host="10.0.0.7")
    kinds = {
        Reach.SAME_NODE: SharedMemory, Reach.OTHER_NODES: ProcessGroup, Reach.IN_PROCESS: InProcess, Reach.MIXED: Mixed,
    }  # fmt: skip
    try:
        for reach, kind in kinds.items():
            transport = sender._transport_for(reach, frozenset({0}))
            assert type(transport) is kind and transport.reach is reach
            assert sender._transport_for(reach, frozenset({0})) is transport  # kept from sync to sync
        assert sender._transport_for(Reach.MIXED, frozenset({1})) is not transport  # an engine moved: new
        assert sender.transport.names == {"shared_memory", "process_group"}
        assert sender._transport_for(Reach.OTHER_NODES).host == "10.0.0.7"  # the store other nodes reach
    finally:
        sender.close()
    shared = SharedMemory(1024)
    try:
        assert shared.shared_memory and shared.packer.slots is not None and shared.packer is shared.packer
    finally:
        shared.close()
    assert not InProcess(1024).shared_memory and InProcess(1024).packer.slots is None
