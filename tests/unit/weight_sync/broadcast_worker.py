"""Processes of test_broadcast.py: one sender and its receivers of a broadcast stream (gloo)."""

from __future__ import annotations

import time
from typing import Any

import torch

from moe_rl.config.schema import QuantConfig
from moe_rl.weight_sync import broadcast
from moe_rl.weight_sync.broadcast import GroupSpec, StreamReceiver, open_group, send_stream
from moe_rl.weight_sync.buckets import BucketPacker
from moe_rl.weight_sync.receiver import decoded
from moe_rl.weight_sync.wire import WireEncoder

CAPACITY = 4096
SURVIVOR_DEADLINE_S = 60.0
"""How long the receiver that outlives a broken stream waits for the stream to end."""


def weights() -> list[tuple[str, torch.Tensor]]:
    """Weights of several sizes: small ones packed together, one larger than a bucket (row chunks)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (16, 16), "b.weight": (8, 4), "big.weight": (128, 64), "norm.weight": (32,)}
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]


def quant(method: str) -> QuantConfig:
    if method == "none":
        return QuantConfig()
    return QuantConfig(name="fp8_tensor", method="fp8", granularity="tensor")


def groups(encoder: WireEncoder):
    for name, tensor in weights():
        yield from encoder.lazy_groups([(name, tensor)], CAPACITY)


def run(rank: int, spec: GroupSpec, method: str, out: dict) -> Any:
    """This member's part; its group."""
    group = open_group(spec, rank) if rank == 0 else None
    if rank == 0:
        encoder = WireEncoder(quant(method), num_layers=1, quantized_wire=True)
        sent = send_stream(group, BucketPacker(CAPACITY, buffers=2).pack(groups(encoder)))
        out[rank] = {"buckets": sent.buckets, "bytes": sent.bytes}
        return group
    receiver = StreamReceiver(spec, rank)
    got: dict[str, torch.Tensor] = {}
    from moe_rl.weight_sync.wire import Rejoin

    rejoin = Rejoin()
    largest = [0]

    def on_bucket(bucket) -> None:
        largest[0] = max(largest[0], bucket.nbytes)
        if rank == 2:  # a slow receiver: the stream's thread must not take a bucket into a slab in use
            time.sleep(0.02)
        for name, tensor in decoded(bucket, rejoin=rejoin):
            got[name] = tensor.clone()

    streamed = receiver.receive(on_bucket)
    rejoin.finish()
    out[rank] = {
        "buckets": streamed.buckets, "largest": largest[0], "slabs": [int(s.numel()) for s in receiver.slabs],
        "tensors": got,
    }  # fmt: skip
    return receiver.group


def main(rank: int, spec: GroupSpec, method: str, folder: str, header_bytes: int) -> None:
    broadcast.HEADER_BYTES = header_bytes  # small: every header also travels in a second message
    out: dict = {}
    group = run(rank, spec, method, out)
    torch.save(out[rank], f"{folder}/rank{rank}.pt")
    group.barrier().wait()  # no member leaves (closing its connections) while another still works


def main_broken(rank: int, streams_in, folder: str) -> None:
    """A sync by the process-group transport whose receiver 2 dies at its third bucket: the sender's
    stream stops there and the sender takes part in the gathers of every tensor left (as a trainer
    rank must: the others wait on them); receiver 1 (an engine's `StreamThreads`) learns the stream
    broke when it waits for its end. ``streams_in``: each receiver's queue, which the sender hands
    its stream to (as Ray hands an engine its call)."""
    import os

    from moe_rl.weight_sync.broadcast import StreamBroken, StreamThreads
    from moe_rl.weight_sync.outgoing import Outgoing
    from moe_rl.weight_sync.transport import ProcessGroup, Receiver

    if rank == 0:
        weights = [(f"w{i}", torch.full((256, 1024), float(i))) for i in range(40)]  # 1 MiB each, held
        gathered = []  # as a trainer holds its parameters

        def tensors():  # each counted as it is "gathered"
            for i, item in enumerate(weights):
                gathered.append(i)
                yield [item]

        transport = ProcessGroup(1 << 20, host="127.0.0.1")
        receivers = {r: Receiver(streams_in[r].put, key=r, near=False) for r in (1, 2)}
        out = transport.send(Outgoing(tensors, WireEncoder(QuantConfig(), 1)), receivers, 60.0)
        torch.save(
            {"gathered": len(gathered), "sent": out.buckets, "group": transport.group}, f"{folder}/rank0.pt"
        )
        return
    landed = []

    def on_bucket(bucket) -> None:
        landed.append(bucket.index)
        if rank == 2 and len(landed) == 3:
            os._exit(0)  # as a crash would

    streams = StreamThreads()
    streams.start(streams_in[rank].get(timeout=120), on_bucket)
    try:  # a stream still running at the deadline ends as `StreamBroken` naming it ("did not end")
        streams.wait(timeout_s=SURVIVOR_DEADLINE_S)
        error = None
    except StreamBroken as exc:
        error = str(exc)
    torch.save({"error": error, "landed": len(landed)}, f"{folder}/rank1.pt")


def far_receiver(streams_in, folder: str) -> None:
    """A receiver on another node of a mixed sync: it takes the stream the sender hands it."""
    from moe_rl.weight_sync.broadcast import StreamThreads
    from moe_rl.weight_sync.wire import Rejoin

    rejoin, got = Rejoin(), {}

    def on_bucket(bucket) -> None:
        time.sleep(0.01)  # slow: the sender's slots must wait for the broadcast, not for this receiver
        for name, tensor in decoded(bucket, rejoin=rejoin):
            got[name] = tensor.clone()

    streams = StreamThreads()
    streams.start(streams_in.get(timeout=120), on_bucket)
    streams.wait(timeout_s=120.0)
    rejoin.finish()
    torch.save(got, f"{folder}/far.pt")
