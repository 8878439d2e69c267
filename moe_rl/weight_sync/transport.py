"""How a sender's buckets reach its receivers: one interface, one class per way.

A `Transport` gives the sender its packer (kept from sync to sync, so its buffers or shared slots
are reused) and turns each packed bucket into the message a receiver is handed:

* `SharedMemory`: every receiver is on the sender's node. Buckets are written into the sender's
  shared-memory slots (`moe_rl.weight_sync.shm`), a CPU trainer's parameters into a shared arena
  once, and the message is the bucket itself (entries and slot names): receivers read the bytes
  where they lie;
* `ObjectStore`: receivers on other nodes. Each bucket is put into Ray's object store once, for
  every receiver;
* `InProcess`: the receiver is in the sender's process (the one-process loop): the message is the
  bucket, valid until the next one is packed.

Which one a sync uses is the sender's choice from where its receivers are (`Reach`,
`moe_rl.weight_sync.sender.RankSender`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Any

from moe_rl.weight_sync.buckets import Bucket, BucketPacker
from moe_rl.weight_sync.shm import SharedArena, SharedSlots


class Reach(StrEnum):
    """Where a sender's receivers are."""

    IN_PROCESS = "in_process"
    SAME_NODE = "same_node"
    OTHER_NODES = "other_nodes"


def reach_of(nodes: dict[int, str | None], here: str) -> tuple[Reach, set[int]]:
    """Where a sender's receivers are, from each one's node (None: its process is gone): on the
    sender's node when every live one is, else on other nodes; and the receivers that are gone."""
    dead = {i for i, node in nodes.items() if node is None}
    alive = [node for node in nodes.values() if node is not None]
    return (Reach.SAME_NODE if all(node == here for node in alive) else Reach.OTHER_NODES), dead


class Transport(ABC):
    """How buckets travel (see the module docstring)."""

    reach: Reach

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

    @property
    def shared_memory(self) -> bool:
        """Buckets travel through shared memory (receivers read them in place)."""
        return False

    def close(self) -> None:
        """Release what the transport holds (its packer's buffers; shared slots)."""
        self._packer = None


class InProcess(Transport):
    reach = Reach.IN_PROCESS

    def message(self, bucket: Bucket) -> Any:
        return bucket


class ObjectStore(Transport):
    reach = Reach.OTHER_NODES

    def message(self, bucket: Bucket) -> Any:
        """One copy of ``bucket`` in Ray's object store, for every receiver."""
        import ray

        return ray.put(bucket)


class SharedMemory(Transport):
    reach = Reach.SAME_NODE

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
