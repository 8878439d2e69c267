"""How a sender's buckets reach its receivers: one interface, one class per way.

A `Transport` gives the sender its packer (kept from sync to sync, so its buffers or shared slots
are reused) and turns each packed bucket into the message a receiver is handed:

* `SharedMemory`: every receiver is on the sender's node. Buckets are written into the sender's
  shared-memory slots (`moe_rl.weight_sync.shm`), a CPU trainer's parameters into a shared arena
  once, and the message is the bucket itself (entries and slot names): receivers read the bytes
  where they lie;
* `ProcessGroup`: receivers on other nodes. The sender and its receivers form a process group of
  their own (gloo on CPU, NCCL between GPUs) and the buckets are broadcast in it
  (`moe_rl.weight_sync.broadcast`): the bytes cross the network once, straight into each receiver;
* `Mixed`: receivers on the sender's node and on others at once: each bucket is packed once into a
  shared slot, read there by the near receivers and broadcast from there to the far ones;
* `DeviceIpc`: every receiver shares the sender's device (a Megatron engine colocated with its
  trainer rank on one GPU): buckets are packed into two buffers in the sender's device memory, and
  the message is the bucket's entries and the buffer's IPC handle (`moe_rl.weight_sync.ipc`): the
  receiver reads the bytes where they lie, GPU to GPU;
* `InProcess`: the receiver is in the sender's process (the one-process loop): the message is the
  bucket, valid until the next one is packed.

Which one a sync uses is the sender's choice from where its receivers are (`Reach`,
`moe_rl.weight_sync.sender.RankSender`).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.buckets import Bucket, BucketPacker
from moe_rl.weight_sync.shm import SharedArena, SharedSlots

log = logging.getLogger(__name__)


class Reach(StrEnum):
    """Where a sender's receivers are."""

    IN_PROCESS = "in_process"
    SAME_NODE = "same_node"
    OTHER_NODES = "other_nodes"
    MIXED = "mixed"
    """Some on the sender's node, the others on other nodes."""


@dataclass(frozen=True)
class Where:
    """Where a sender's receivers are (`reach_of`)."""

    reach: Reach
    dead: frozenset[int]
    """Receivers whose process is gone."""
    local: frozenset[int]
    """Live receivers on the sender's node."""


def reach_of(nodes: dict[int, str | None], here: str) -> Where:
    """Where a sender's receivers are, from each one's node (None: its process is gone): on the
    sender's node when every live one is, on other nodes when none is, else mixed."""
    dead = frozenset(i for i, node in nodes.items() if node is None)
    local = frozenset(i for i, node in nodes.items() if node == here)
    alive = len(nodes) - len(dead)
    reach = Reach.SAME_NODE if len(local) == alive else Reach.MIXED if local else Reach.OTHER_NODES
    return Where(reach, dead, local)


class Transport(ABC):
    """How buckets travel (see the module docstring)."""

    reach: Reach
    name: str
    """What a sync records as its transport (``sync/transport``)."""

    @property
    def names(self) -> set[str]:
        """The transports a sync records (a transport made of others names each)."""
        return {self.name}

    def __init__(self, capacity: int, sender: int = 0):
        self.capacity, self.sender = capacity, sender
        self._packer: BucketPacker | None = None

    @property
    def packer(self) -> BucketPacker:
        """The packer of this transport's buckets (made once, kept from sync to sync)."""
        if self._packer is None:
            self._packer = self._make_packer()
        return self._packer

    def _make_packer(self) -> BucketPacker:
        return BucketPacker(self.capacity, sender=self.sender)

    @abstractmethod
    def message(self, bucket: Bucket) -> Any:
        """What every receiver is handed for ``bucket``."""

    def send(
        self, buckets: Iterable[Bucket], receivers: dict[int, Callable[[Any], Any]], timeout_s: float,
        members: tuple = (),
    ) -> Published:  # fmt: skip
        """Deliver ``buckets`` to ``receivers`` (`publish`: each bucket handed to every receiver).
        ``members`` names the receivers' processes (a transport that keeps state per set of
        receivers rebuilds it when they change)."""
        return publish(buckets, receivers, timeout_s, self)

    @property
    def shared_memory(self) -> bool:
        """Buckets travel through shared memory (receivers read them in place)."""
        return False

    def close(self) -> None:
        """Release what the transport holds (its packer's buffers; shared slots)."""
        self._packer = None


class InProcess(Transport):
    reach = Reach.IN_PROCESS
    name = "in_process"

    def message(self, bucket: Bucket) -> Any:
        return bucket


class SharedMemory(Transport):
    reach = Reach.SAME_NODE
    name = "shared_memory"

    def __init__(self, capacity: int, sender: int = 0, arena: SharedArena | None = None):
        """``arena``: a CPU trainer's parameters in shared memory (`moe_rl.weight_sync.sender.
        share_parameters`): tensors that travel as they are are read where the trainer holds them."""
        super().__init__(capacity, sender)
        self.arena = arena

    def _make_packer(self) -> BucketPacker:
        slots = SharedSlots(self.capacity, tag=str(self.sender))
        return BucketPacker(self.capacity, sender=self.sender, slots=slots, arena=self.arena)

    def message(self, bucket: Bucket) -> Any:
        return bucket

    @property
    def shared_memory(self) -> bool:
        return True

    def close(self) -> None:
        if self._packer is not None and self._packer.slots is not None:
            self._packer.slots.close()
        super().close()


class DeviceIpc(Transport):
    """Buckets in two buffers of the sender's device memory, handed to receivers on its machine by
    IPC handle (see the module docstring). Each buffer is shared once (its handle is kept) and
    again only when it grows; `publish` awaits a bucket's deliveries before its buffer is packed
    again."""

    reach = Reach.SAME_NODE
    name = "device_ipc"

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
        return Bucket(
            bucket.entries, None, bucket.index, bucket.sender, part=bucket.part, last=bucket.last, ipc=ref
        )

    @property
    def shared_memory(self) -> bool:
        return True

    def close(self) -> None:
        self._handles = {}
        super().close()


class ProcessGroup(Transport):
    """Buckets broadcast to receivers on other nodes in a process group of the sender and its
    receivers (`moe_rl.weight_sync.broadcast`): the bytes cross the network once, straight into
    each receiver's slab, never through Ray's object store. The group is made at the first sync and
    kept while the receivers are the same processes (``members``)."""

    reach = Reach.OTHER_NODES
    name = "process_group"

    def __init__(self, capacity: int, sender: int = 0, host: str | None = None, device: str = "cpu"):
        super().__init__(capacity, sender)
        self.host = host or socket.gethostbyname(socket.gethostname())
        self.device = device
        self.group: Any = None
        self.spec: Any = None
        self.members: tuple = ()

    def _make_packer(self) -> BucketPacker:
        return BucketPacker(self.capacity, sender=self.sender, buffers=2)  # one packed while one is sent

    def message(self, bucket: Bucket) -> Any:  # buckets are broadcast, never handed over one by one
        raise NotImplementedError("a process-group transport broadcasts buckets (`send`)")

    def send(
        self, buckets: Iterable[Bucket], receivers: dict[int, Callable[[Any], Any]], timeout_s: float,
        members: tuple = (),
    ) -> Published:  # fmt: skip
        """Ask each receiver to join the stream (one call each: they take every bucket of it), then
        broadcast the buckets; the receivers whose process died on the way."""
        from moe_rl.weight_sync.broadcast import (
            BroadcastStream,
            GroupSpec,
            open_group,
            open_store,
            send_stream,
        )

        order = sorted(receivers)
        members = tuple(members) or tuple(order)
        fresh = self.group is None or members != self.members
        store = None
        if fresh:  # the store listens before any receiver is told where it is
            store = open_store(self.host, len(order) + 1)
            key = f"moe-rl-sync/{self.sender}/{uuid.uuid4().hex}/"
            self.spec = GroupSpec(self.host, store.port, len(order) + 1, key, self.device, self.sender)
            self.members, self.group = members, None
        joined = [
            (i, receivers[i](BroadcastStream(self.spec, rank))) for rank, i in enumerate(order, start=1)
        ]
        dead = settle(joined, timeout_s)  # each receiver took the stream (it returns at once)
        if (
            dead
        ):  # no stream: the others' break (a kept group closes; a new one fails to form) and are synced again
            self.group = None
            gc.collect()
            for _ in buckets:  # packing still joins the trainer ranks' gathers
                pass
            return Published(dead=dead)
        if fresh:
            self.group = open_group(self.spec, 0, store=store)  # the members meet here, at this store
        streamed = send_stream(self.group, buckets, self.device, buffers=len(self.packer.buffers))
        if streamed.broken:  # the next sync makes a new group of the live receivers
            self.group = None
            gc.collect()  # the broken group's connections close: its live receivers stop waiting
            log.warning(
                "the weight stream of trainer rank %d broke (%s); the engines cut off are synced again",
                self.sender, streamed.broken.splitlines()[0][:300],
            )  # fmt: skip
        return Published(bytes=streamed.bytes, buckets=streamed.buckets, largest=streamed.largest)

    def close(self) -> None:
        self.group = None
        super().close()


class Mixed(Transport):
    """Receivers on the sender's node (``local``) and on other nodes at once: every bucket is packed
    once, into a shared slot; the near receivers read it there (`SharedMemory`) and the far ones
    take it by the process group's broadcast from that slot (`ProcessGroup`). A slot is reused once
    its bucket was delivered both ways. Tensors are always written into the slots (no shared arena:
    what the far receivers are sent must lie in the bucket)."""

    reach = Reach.MIXED
    name = "mixed"

    def __init__(
        self, capacity: int, sender: int = 0, host: str | None = None, device: str = "cpu",
        local: frozenset[int] = frozenset(),
    ):  # fmt: skip
        super().__init__(capacity, sender)
        self.near = SharedMemory(capacity, sender)
        self.far = ProcessGroup(capacity, sender, host, device)
        self.local = frozenset(local)

    @property
    def names(self) -> set[str]:
        return {self.near.name, self.far.name}

    def _make_packer(self) -> BucketPacker:
        return self.near.packer

    def message(self, bucket: Bucket) -> Any:
        return self.near.message(bucket)

    @property
    def shared_memory(self) -> bool:
        return True

    def send(
        self, buckets: Iterable[Bucket], receivers: dict[int, Callable[[Any], Any]], timeout_s: float,
        members: tuple = (),
    ) -> Published:  # fmt: skip
        """Hand each bucket to the near receivers, then broadcast it to the far ones."""
        order = sorted(receivers)
        near = {i: receivers[i] for i in order if i in self.local}
        far = {i: receivers[i] for i in order if i not in self.local}
        far_members = (
            tuple(m for i, m in zip(order, members, strict=True) if i not in self.local) if members else ()
        )
        out = Published()
        stream = handed(buckets, near, timeout_s, self.near, out)
        out.dead |= self.far.send(stream, far, timeout_s, far_members).dead
        return out

    def close(self) -> None:
        self.far.close()
        self.near.close()
        super().close()


@dataclass
class Published:
    """What one sender's stream delivered."""

    bytes: int = 0
    in_place: int = 0
    """Of ``bytes``, those the receivers read where the sender holds them (its shared arena)."""
    buckets: int = 0
    largest: int = 0
    """Bytes of the largest bucket."""
    dead: set[int] = field(default_factory=set)
    """Receivers whose process died on the way (they got no later bucket)."""


def publish(
    buckets: Iterable[Bucket],
    receivers: dict[int, Callable[[Any], Any]],
    timeout_s: float,
    transport: Transport | None = None,
) -> Published:
    """Deliver every bucket to every receiver, with at most two buckets in flight: bucket ``i`` is
    handed to all receivers, then the deliveries of bucket ``i - 1`` are awaited, so the packer's
    buffer (or shared slot) of bucket ``i - 1`` is free again when bucket ``i + 1`` is packed.

    A bucket that travels in parts (`buckets.BucketPacker` with shared slots) is handed over part
    by part as each is written; the deliveries of bucket ``i - 1`` are awaited after the last part
    of bucket ``i``, so receivers work through their queue of parts while the sender writes ahead.

    ``receivers`` maps a receiver's index to a function that starts its delivery (a Ray call
    returning an object reference, or a call in this process returning its result). The
    ``transport`` turns each bucket into what receivers are handed (default: a bucket in a shared
    slot as itself, any other once into Ray's object store).
    """
    out = Published()
    for _ in handed(buckets, receivers, timeout_s, transport, out):
        pass
    return out


def handed(
    buckets: Iterable[Bucket],
    receivers: dict[int, Callable[[Any], Any]],
    timeout_s: float,
    transport: Transport | None,
    out: Published,
) -> Iterator[Bucket]:
    """`publish`, bucket by bucket: each bucket (or part) is yielded once every receiver has been
    handed it and the deliveries `publish` awaits before the next one is packed have landed; what
    was delivered is counted into ``out`` as it goes (complete when the iteration ends)."""
    alive = dict(receivers)
    in_flight: list[tuple[int, Any]] = []  # deliveries of the previous bucket
    current: list[tuple[int, Any]] = []  # deliveries of this bucket's parts so far
    size = 0
    for bucket in buckets:
        if transport is not None:
            message = transport.message(bucket)
        else:
            message = bucket if bucket.slot is not None else _in_object_store(bucket)
        current += [(i, deliver(message)) for i, deliver in alive.items()]
        out.bytes += bucket.nbytes
        out.in_place += sum(entry.nbytes for entry in bucket.entries if entry.source is not None)
        size += bucket.nbytes
        if bucket.last:
            out.dead |= settle(in_flight, timeout_s)
            in_flight, current = current, []
            for i in out.dead:
                alive.pop(i, None)
            out.buckets += 1
            out.largest = max(out.largest, size)
            size = 0
        yield bucket
    out.dead |= settle(in_flight + current, timeout_s)


def _in_object_store(bucket: Bucket) -> Any:
    """One copy of `bucket` in Ray's object store, for every receiver. (Buckets in shared slots
    never go there, so `publish` of those runs without Ray.)"""
    import ray

    return ray.put(bucket)


def settle(flight: list[tuple[int, Any]], timeout_s: float) -> set[int]:
    """Wait for deliveries (Ray's object references; a delivery in this process is done already);
    the indices of receivers whose process died."""
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
