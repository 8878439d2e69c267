"""The process-group transport between processes (gloo): a sender broadcasts its buckets, every
receiver rebuilds them and decodes exactly what a receiver of the same buckets handed over in one
process decodes, into two slabs of at most the largest bucket each."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from moe_rl.weight_sync.broadcast import HEADER_BYTES, GroupSpec
from moe_rl.weight_sync.buckets import SLACK, BucketPacker
from moe_rl.weight_sync.receiver import decoded
from moe_rl.weight_sync.wire import Rejoin, WireEncoder
from tests.unit.weight_sync.broadcast_worker import CAPACITY, groups, main, main_broken, quant, weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_one_process(method: str) -> dict[str, torch.Tensor]:
    encoder = WireEncoder(quant(method), num_layers=1, quantized_wire=True)
    rejoin, got = Rejoin(), {}
    for bucket in BucketPacker(CAPACITY).pack(groups(encoder)):
        for name, tensor in decoded(bucket, rejoin=rejoin):
            got[name] = tensor.clone()
    return got


@pytest.mark.distributed
@pytest.mark.parametrize("method, header_bytes", [("none", HEADER_BYTES), ("fp8", 64)])
def test_two_receivers_decode_what_one_process_decodes(method, header_bytes, tmp_path):
    """The sender packs ahead into two buffers; one receiver lands slowly (its stream's thread waits
    for a free slab); with ``header_bytes`` 64 every header travels in two messages."""
    spec = GroupSpec("127.0.0.1", _free_port(), 3, f"test/{method}/", sender=0)
    mp.start_processes(main, args=(spec, method, str(tmp_path), header_bytes), nprocs=3, start_method="spawn")
    sent = torch.load(tmp_path / "rank0.pt")
    want = _in_one_process(method)
    assert set(want) == {name for name, _ in weights()}  # the large weight rejoined from its row chunks
    for rank in (1, 2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["buckets"] == sent["buckets"] > 2
        assert set(got["tensors"]) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got["tensors"][name], tensor), name
        # two slabs, each the size of the largest bucket (a per-tensor FP8 weight is one bucket of its own)
        assert len(got["slabs"]) == 2 and max(got["slabs"]) <= max(got["largest"], CAPACITY) + SLACK


@pytest.mark.distributed
def test_a_receiver_that_dies_breaks_the_stream_and_the_sender_joins_the_gathers_left(tmp_path):
    ctx = mp.get_context("spawn")
    streams = {rank: ctx.Queue() for rank in (1, 2)}
    procs = [ctx.Process(target=main_broken, args=(rank, streams, str(tmp_path))) for rank in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    codes = [proc.exitcode for proc in procs]
    assert codes == [0, 0, 0], f"exit codes {codes} (None: still running after 120 s)"
    sender, survivor = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    # the stream stopped (no buckets reported, the group dropped for the next sync to make anew), and
    # every tensor was still gathered: the other trainer ranks' collectives went on
    assert sender["sent"] == 0 and sender["group"] is None and sender["gathered"] == 40
    # the survivor learnt from its own stream that it broke, not by waiting out its deadline
    assert survivor["error"] is not None, "the survivor's stream ended as if it were whole"
    assert survivor["error"].startswith("a weight stream broke: "), survivor["error"]
    # it landed the buckets broadcast before receiver 2 died at its third, and not the whole stream
    assert 3 <= survivor["landed"] < 40


@pytest.mark.distributed
def test_a_mixed_sync_hands_each_bucket_to_near_receivers_and_broadcasts_it_to_far_ones(tmp_path):
    """The ``buckets`` route with receivers on the sender's node and on another (`transport.HostBuckets`):
    one packing into the shared slots; the near receiver (here in the sender's process) reads each
    bucket there, the far one (another process) takes the broadcast from the slot; both decode exactly
    what one process decodes, and the report counts the buckets once."""
    from moe_rl.weight_sync.outgoing import Outgoing
    from moe_rl.weight_sync.transport import HostBuckets, Receiver
    from tests.unit.weight_sync.broadcast_worker import far_receiver

    ctx = mp.get_context("spawn")
    streams = ctx.Queue()
    far = ctx.Process(target=far_receiver, args=(streams, str(tmp_path)))
    far.start()
    near: dict[str, torch.Tensor] = {}
    rejoin = Rejoin()

    def near_receiver(bucket):
        assert bucket.slot is not None  # read where the sender wrote it
        for name, tensor in decoded(bucket, rejoin=rejoin):
            near[name] = tensor.clone()
        return {"bytes": bucket.nbytes}

    transport = HostBuckets(CAPACITY, host="127.0.0.1")
    receivers = {0: Receiver(near_receiver, key="near"), 1: Receiver(streams.put, key="far", near=False)}
    try:
        encoder = WireEncoder(quant("fp8"), num_layers=1, quantized_wire=True)
        outgoing = Outgoing(lambda: ([item] for item in weights()), encoder)
        out = transport.send(outgoing, receivers, 60.0)
    finally:
        far.join(120)
        transport.close()
    assert far.exitcode == 0
    rejoin.finish()
    want = _in_one_process("fp8")
    got = torch.load(tmp_path / "far.pt")
    assert set(near) == set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(near[name], tensor) and torch.equal(got[name], tensor), name
    assert out.buckets > 2 and not out.dead and out.transports == {"shared_memory", "process_group"}
