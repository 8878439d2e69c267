"""How a trainer rank's weights reach its receivers: one interface (`Transport`), one class per way, made once
for a route of the run's `SyncPlan` and kept with its buffers, slots and groups: `InProcess`, `HostBuckets`
(`SharedMemory` near, `ProcessGroup` far), `DeviceIpc`, and vLLM's transfer (`vllm_transfer`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.broadcast import BroadcastStream, GroupSpec, open_group, open_store, send_stream
from moe_rl.weight_sync.buckets import Bucket, BucketPacker
from moe_rl.weight_sync.outgoing import Outgoing
from moe_rl.weight_sync.shm import SharedArena, SharedSlots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Receiver:
    """One receiving process of a sync, as its sender sees it."""

    deliver: Callable[[Any], Any]
    """Hands it a message (a bucket, a stream, a vLLM call): a Ray call, or a call in this process."""
    key: Hashable = None
    """Its process (a restarted engine is another): a group of receivers is made anew when it changes."""
    near: bool = True
    """On the sender's node."""


Receivers = dict[int, Receiver]
"""A sync's receivers by index."""


@dataclass
class Published:
    """What one sender's sync delivered: its part of the sync's `report.SyncReport`."""

    bytes: int = 0
    in_place: int = 0
    buckets: int = 0
    dead: set[int] = field(default_factory=set)
    transports: set[str] = field(default_factory=set)
    shared_memory: bool = False


class Transport(ABC):
    """How a rank's weights travel: `send` is one sync of a rank's `outgoing.Outgoing` to its
    receivers; a rank given none only takes part in the others' gathers."""

    name: str
    """What a sync records as its transport (``sync/transport``)."""

    def __init__(self, capacity: int, sender: int = 0):
        self.capacity, self.sender = capacity, sender

    @abstractmethod
    def send(self, outgoing: Outgoing, receivers: Receivers, timeout_s: float) -> Published:
        """One sync of ``outgoing`` to ``receivers`` (none: only join the others' gathers)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (buffers, shared slots, groups)."""

    def release(self) -> None:
        """Give back the device memory it keeps between syncs (a colocated generation needs it); the
        next sync makes it again. Nothing by default: only `DeviceIpc` keeps device memory."""
        return None


class BucketTransport(Transport):
    """Buckets packed by a packer kept from sync to sync, each handed on as `message` makes it (`publish`)."""

    shared_memory = False

    def __init__(self, capacity: int, sender: int = 0):
        super().__init__(capacity, sender)
        self._packer: BucketPacker | None = None

    @property
    def packer(self) -> BucketPacker:
        if self._packer is None:
            self._packer = self._make_packer()
        return self._packer

    def _make_packer(self) -> BucketPacker:
        return BucketPacker(self.capacity, sender=self.sender)

    def send(self, outgoing: Outgoing, receivers: Receivers, timeout_s: float) -> Published:
        out = Published()
        if receivers:
            out = self.deliver(self.packer.pack(outgoing.groups(self.packer.capacity)), receivers, timeout_s)
        outgoing.join_gathers()  # all of them without receivers; the rest if the delivery stopped early
        if out.buckets:
            out.transports.add(self.name)
            out.shared_memory = self.shared_memory
        return out

    def deliver(self, buckets: Iterable[Bucket], receivers: Receivers, timeout_s: float) -> Published:
        return publish(buckets, {i: r.deliver for i, r in receivers.items()}, timeout_s, self)

    def message(self, bucket: Bucket) -> Any:
        """What every receiver is handed for ``bucket``: the bucket itself."""
        return bucket

    def close(self) -> None:
        self._packer = None


class InProcess(BucketTransport):
    """Each bucket handed over as it is, valid until the next one is packed."""

    name = "in_process"


class SharedMemory(BucketTransport):
    """Buckets written into the sender's shared-memory slots (`shm`), read there by its node's receivers."""

    name = "shared_memory"
    shared_memory = True

    def __init__(self, capacity: int, sender: int = 0, arena: SharedArena | None = None):
        """``arena``: the sender's parameters in shared memory (`sender.share_parameters`)."""
        super().__init__(capacity, sender)
        self.arena = arena

    def _make_packer(self) -> BucketPacker:
        slots = SharedSlots(self.capacity, tag=str(self.sender))
        return BucketPacker(self.capacity, sender=self.sender, slots=slots, arena=self.arena)

    def close(self) -> None:
        if self._packer is not None:
            self._packer.slots.close()
        super().close()


class DeviceIpc(BucketTransport):
    """Buckets in two device buffers of the sender, handed by IPC handle (`ipc`), shared anew once grown."""

    name = "device_ipc"
    shared_memory = True

    def __init__(self, capacity: int, sender: int = 0, device: torch.device | str = "cpu"):
        super().__init__(capacity, sender)
        self.device = torch.device(device)
        self._handles: dict[int, tuple[torch.Tensor, bytes]] = {}  # buffer slot -> (the buffer, its handle)

    def _make_packer(self) -> BucketPacker:
        return BucketPacker(self.capacity, sender=self.sender, buffers=2, device=self.device)

    def message(self, bucket: Bucket) -> Any:
        slot = bucket.index % len(self.packer.buffers)  # where the packer wrote bucket ``index``
        buffer = self.packer.buffers[slot]
        kept = self._handles.get(slot)
        if kept is None or kept[0] is not buffer:  # a new or grown buffer (the old one is kept till here)
            kept = self._handles[slot] = (buffer, ipc.share(buffer))  # a CPU buffer moves to shared memory
        ipc.ready(self.device)  # the bytes are written before a receiver reads them
        offset = bucket.buffer.data_ptr() - buffer.data_ptr()
        ref = ipc.IpcRef(kept[1], (os.getpid(), self.sender, slot), offset, bucket.buffer.numel())
        return dataclasses.replace(bucket, buffer=None, ipc=ref)

    def close(self) -> None:
        self._handles = {}
        super().close()

    def release(self) -> None:
        """The two buffers go (their receivers dropped their mappings when their sync finished,
        `ipc.close_opened`); the next sync packs into new ones and shares those."""
        self.close()
        ipc.collect(self.device)


class ProcessGroup(BucketTransport):
    """Buckets broadcast in a group of the sender and its receivers (`broadcast`), kept while they stay."""

    name = "process_group"

    def __init__(self, capacity: int, sender: int = 0, host: str | None = None, device: str = "cpu"):
        super().__init__(capacity, sender)
        self.host = host or socket.gethostbyname(socket.gethostname())
        self.device = device
        self.group, self.spec, self.members = None, None, ()

    def _make_packer(self) -> BucketPacker:
        return BucketPacker(self.capacity, sender=self.sender, buffers=2)  # one packed while one is sent

    def deliver(self, buckets: Iterable[Bucket], receivers: Receivers, timeout_s: float) -> Published:
        """Ask each receiver to join the stream (one call each), then broadcast the buckets, up to a break."""
        order = sorted(receivers)
        members = tuple(receivers[i].key for i in order)
        fresh = self.group is None or members != self.members
        store = None
        if fresh:  # the store listens before any receiver is told where it is
            store = open_store(self.host, len(order) + 1)
            key = f"moe-rl-sync/{self.sender}/{uuid.uuid4().hex}/"
            self.spec = GroupSpec(self.host, store.port, len(order) + 1, key, self.device, self.sender)
            self.members, self.group = members, None
        joined = [
            (i, receivers[i].deliver(BroadcastStream(self.spec, rank)))
            for rank, i in enumerate(order, start=1)
        ]
        dead = settle(joined, timeout_s)  # each receiver took the stream (it returns at once)
        if dead:  # the others' streams break (a kept group closes; a new one fails to form)
            self._drop()
            return Published(dead=dead)
        if fresh:
            self.group = open_group(self.spec, 0, store=store)  # the members meet here, at this store
        streamed = send_stream(self.group, buckets, self.device)
        if streamed.broken:  # the next sync makes a new group of the live receivers
            self._drop()
            log.warning(
                "the weight stream of trainer rank %d broke (%s); the engines cut off are synced again",
                self.sender, streamed.broken.splitlines()[0][:300],
            )  # fmt: skip
            return Published(bytes=streamed.bytes)
        return Published(bytes=streamed.bytes, buckets=streamed.buckets)

    def _drop(self) -> None:
        """Forget the group: its connections close, so its live receivers stop waiting."""
        self.group = None
        gc.collect()

    def close(self) -> None:
        self.group = None
        super().close()


class HostBuckets(Transport):
    """The ``buckets`` route, by where a sync's receivers are: `SharedMemory`, `ProcessGroup` or `_Both` (the
    ways a sync does not take are closed)."""

    name = "buckets"

    def __init__(
        self, capacity: int, sender: int = 0, host: str | None = None, device: str = "cpu",
        arena: Callable[[], SharedArena | None] = lambda: None,
    ):  # fmt: skip
        """``arena``: makes the sender's shared arena (`sender.share_parameters`) when all are near."""
        super().__init__(capacity, sender)
        self._arena, self._args = arena, (host, device)
        self._ways: dict[str, Transport] = {}

    def _way(self, kind: str) -> Transport:
        for other in [k for k in self._ways if k != kind]:
            self._ways.pop(other).close()
        if kind not in self._ways:
            self._ways[kind] = {
                "near": lambda: SharedMemory(self.capacity, self.sender, self._arena()),
                "far": lambda: ProcessGroup(self.capacity, self.sender, *self._args),
                "both": lambda: _Both(self.capacity, self.sender, *self._args),
            }[kind]()
        return self._ways[kind]

    def send(self, outgoing: Outgoing, receivers: Receivers, timeout_s: float) -> Published:
        near = any(r.near for r in receivers.values())
        far = any(not r.near for r in receivers.values())
        kind = "both" if near and far else "far" if far else "near"
        return self._way(kind).send(outgoing, receivers, timeout_s)

    def close(self) -> None:
        for way in self._ways.values():
            way.close()
        self._ways = {}


class _Both(SharedMemory):
    """Near and far receivers at once: each bucket packed once into a shared slot (every tensor written), read
    there by the near ones, broadcast to the far."""

    def __init__(self, capacity: int, sender: int = 0, host: str | None = None, device: str = "cpu"):
        super().__init__(capacity, sender)
        self.far = ProcessGroup(capacity, sender, host, device)

    def deliver(self, buckets: Iterable[Bucket], receivers: Receivers, timeout_s: float) -> Published:
        near = {i: r.deliver for i, r in receivers.items() if r.near}
        out = Published()
        stream = handed(buckets, near, timeout_s, self, out)
        far = self.far.deliver(stream, {i: r for i, r in receivers.items() if not r.near}, timeout_s)
        for _ in stream:  # a broken broadcast: the near receivers still take every bucket
            pass
        out.dead |= far.dead
        out.transports.add(self.far.name)
        return out

    def close(self) -> None:
        self.far.close()
        super().close()


def publish(
    buckets: Iterable[Bucket],
    receivers: dict[int, Callable[[Any], Any]],
    timeout_s: float,
    transport: BucketTransport | None = None,
) -> Published:
    """Deliver every bucket (each part as it is written) to every receiver, as ``transport.message``
    makes it (default: the bucket), then await the deliveries of the bucket before, so its buffer or
    shared slot is free when the packer comes back to it: at most two buckets in flight."""
    out = Published()
    for _ in handed(buckets, receivers, timeout_s, transport, out):
        pass
    return out


def handed(
    buckets: Iterable[Bucket],
    receivers: dict[int, Callable[[Any], Any]],
    timeout_s: float,
    transport: BucketTransport | None,
    out: Published,
) -> Iterator[Bucket]:
    """`publish`, bucket by bucket: each bucket (or part) is yielded once every receiver was handed it
    and the deliveries awaited before the next are done; ``out`` is complete when the iteration ends."""
    alive = dict(receivers)
    in_flight: list[tuple[int, Any]] = []  # deliveries of the previous bucket
    current: list[tuple[int, Any]] = []  # deliveries of this bucket's parts so far
    for bucket in buckets:
        message = bucket if transport is None else transport.message(bucket)
        current += [(i, deliver(message)) for i, deliver in alive.items()]
        out.bytes += bucket.nbytes
        out.in_place += sum(entry.nbytes for entry in bucket.entries if entry.source is not None)
        if bucket.last:
            out.dead |= settle(in_flight, timeout_s)
            in_flight, current = current, []
            alive = {i: deliver for i, deliver in alive.items() if i not in out.dead}
            out.buckets += 1
        yield bucket
    out.dead |= settle(in_flight + current, timeout_s)


def settle(flight: list[tuple[int, Any]], timeout_s: float) -> set[int]:
    """Wait for deliveries (Ray object references; the others are done); the receivers whose process died."""
    refs = [(i, ref) for i, ref in flight if type(ref).__name__ == "ObjectRef"]
    if not refs:
        return set()
    import ray

    dead = set()
    for i, ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayActorError:
            dead.add(i)
    return dead
