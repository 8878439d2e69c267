"""The process-group transport's wire: a trainer rank broadcasts its buckets in a ``torch.distributed`` group
of its own with its receivers (gloo or NCCL, outside any default world), so weights cross nodes once: a
fixed-size header (entries and byte layout, pickled), then the bytes; an empty header ends the stream.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import pickle
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from moe_rl.device import transient_bytes
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.shm import aligned

HEADER_BYTES = 1 << 16
"""A bucket's header travels in one message of this size (a longer header: the rest in a second)."""

GROUP_TIMEOUT_S = 1800.0
"""How long a member waits for a broadcast of the group."""

JOIN_TIMEOUT_S = 300.0
"""How long a member waits for the others to form the group (one that never comes fails it then)."""
_JOINING = datetime.timedelta(seconds=JOIN_TIMEOUT_S)


@dataclass(frozen=True)
class GroupSpec:
    """Where the members of one sender's group meet: the sender's TCP store, the group's size, its key
    (the store's prefix: new for every new group), ``cpu`` (gloo) or ``cuda`` (NCCL), the sending rank."""

    host: str
    port: int
    size: int
    key: str
    device: str = "cpu"
    sender: int = 0


@dataclass(frozen=True)
class BroadcastStream:
    """The message a receiver gets instead of a bucket: join the stream of ``spec`` as ``rank``."""

    spec: GroupSpec
    rank: int


def open_store(host: str, size: int) -> Any:
    """The sender's TCP store, on a free port chosen as it binds (``.port``), which no one takes first."""
    return TCPStore(host, 0, size, True, timeout=_JOINING, wait_for_workers=False)


def open_group(spec: GroupSpec, rank: int, store: Any = None) -> Any:
    """This member's side of the group of ``spec`` (collective: every member calls it). The sender
    (rank 0) passes the store it opened (`open_store`); the others connect to it."""
    if store is None:
        store = TCPStore(spec.host, spec.port, spec.size, rank == 0, timeout=_JOINING)
    store = PrefixStore(spec.key, store)
    if spec.device == "cuda":
        from torch.distributed import ProcessGroupNCCL

        return ProcessGroupNCCL(store, rank, spec.size)
    return ProcessGroupGloo(store, rank, spec.size, datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting ``tensor`` from rank 0 (the returned work completes it)."""
    options = BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


@dataclass
class Streamed:
    """What one broadcast stream carried."""

    bytes: int = 0
    buckets: int = 0
    broken: str | None = None
    """Why the stream broke (a member's process died); the others did not get the rest of it."""

    def count(self, bucket: Bucket) -> None:
        self.bytes += bucket.nbytes
        self.buckets += int(bucket.last)


class StreamBroken(RuntimeError):
    """A stream broke before its end: its receiver's weights are partly new; it takes the sync again."""


def send_stream(group: Any, buckets: Iterable[Bucket], device: str = "cpu") -> Streamed:
    """Broadcast every bucket to the group (as rank 0), then the end of the stream, pipelined over a packer of
    two buffers: bucket ``i`` is broadcast while ``i + 1`` is packed, once ``i - 1``'s broadcast has ended. A
    broken connection (a member died) stops the stream (`Streamed.broken`)."""
    out = Streamed()
    before: list[tuple[Any, Any]] = []  # the works of the previous bucket, and what they read
    for bucket in buckets:  # packing this bucket reused the buffer of the one before the previous
        now: list[tuple[Any, Any]] = []
        try:
            _send_bucket(group, bucket, device, now)
            _wait(before)
            before = now
        except RuntimeError as exc:  # the backend's error: a member's connection was lost
            out.broken = str(exc)
            _wait(before + now, broken=True)  # then their buffers may go
            return out
        out.count(bucket)
    end: list[tuple[Any, Any]] = []
    try:
        _wait(before)
        _send_header(group, None, device, end)
        _wait(end)
    except RuntimeError as exc:
        out.broken = str(exc)
        _wait(before + end, broken=True)
    return out


def _send_bucket(group: Any, bucket: Bucket, device: str, works: list[tuple[Any, Any]]) -> None:
    parts = _parts(bucket)
    header = {
        "entries": bucket.entries, "index": bucket.index, "sender": bucket.sender, "part": bucket.part,
        "last": bucket.last, "sizes": [len(p) for p in parts],
    }  # fmt: skip
    _send_header(group, header, device, works)
    for part in parts:
        if len(part):
            tensor = _on(torch.from_numpy(part), device)
            works.append((_broadcast(group, tensor), tensor))


def _wait(works: list[tuple[Any, Any]], broken: bool = False) -> None:
    """Wait for ``works`` to end; those of a ``broken`` stream each as it may (one to a lost member fails)."""
    for work, _ in works:
        with contextlib.suppress(RuntimeError) if broken else contextlib.nullcontext():
            work.wait()


def _parts(bucket: Bucket) -> list[np.ndarray]:
    """The byte ranges of a bucket's tensors: its packed buffer, then each of `Bucket.arrays`."""
    packed = [e for e in bucket.entries if e.source is None and e.array is None]
    end = max((e.offset + e.nbytes for e in packed), default=0)
    head = bucket.data[:end] if end else np.empty(0, dtype=np.uint8)
    return [
        np.ascontiguousarray(head),
        *(
            transient_bytes(a)
            if isinstance(a, torch.Tensor)
            else np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            for a in bucket.arrays
        ),
    ]


def _on(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return tensor if device == "cpu" else tensor.to(device)


def _send_header(group: Any, header: dict | None, device: str, works: list[tuple[Any, Any]]) -> None:
    """Start broadcasting a header: one `HEADER_BYTES` message (its length, 0 to end the stream, then as much
    of it as fits), then the rest."""
    data = b"" if header is None else pickle.dumps(header)
    head = np.zeros(HEADER_BYTES, dtype=np.uint8)
    head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
    fits = min(len(data), HEADER_BYTES - 8)
    head[8 : 8 + fits] = np.frombuffer(data[:fits], dtype=np.uint8)
    tensor = _on(torch.from_numpy(head), device)
    works.append((_broadcast(group, tensor), tensor))
    if len(data) > fits:
        rest = _on(torch.frombuffer(bytearray(data[fits:]), dtype=torch.uint8), device)
        works.append((_broadcast(group, rest), rest))


def _landed(work: Any, into: torch.Tensor, view: torch.Tensor) -> None:
    """Wait for a broadcast into ``into``; then its bytes are in ``view`` (copied there from a GPU)."""
    work.wait()
    if into is not view:
        view.copy_(into)


@dataclass
class StreamReceiver:
    """A receiver's side of one sender's stream: its group and its two byte slabs, kept from sync to sync."""

    spec: GroupSpec
    rank: int
    group: Any = None
    slabs: list[torch.Tensor] = field(default_factory=lambda: [torch.empty(0, dtype=torch.uint8)] * 2)
    _turn: int = 0

    def join(self) -> None:
        if self.group is None:
            self.group = open_group(self.spec, self.rank)

    def receive(self, on_bucket: Callable[[Bucket], Any]) -> Streamed:
        """Hand every bucket of the stream to ``on_bucket`` (which copies what it keeps), while a thread takes
        the next into the other slab (reused only once its bucket was handed on)."""
        self.join()
        out = Streamed()
        arrived: queue.Queue = queue.Queue()
        free = threading.Semaphore(2)  # slabs not holding a bucket that is still to be handed on
        stop = threading.Event()

        def take() -> None:
            try:
                posted = self._post_header()
                while True:
                    header = self._read_header(posted)
                    if header is None:
                        arrived.put(None)
                        return
                    free.acquire()
                    if stop.is_set():
                        return
                    bucket, works = self._post_bucket(header)
                    posted = self._post_header()  # the next header is on its way while these bytes arrive
                    for work in works:
                        work()
                    arrived.put(bucket)
            except BaseException as exc:  # raised in the receiving thread
                arrived.put(exc)

        thread = threading.Thread(target=take, name=f"weight-stream-take-{self.spec.key}", daemon=True)
        thread.start()
        try:
            while True:
                bucket = arrived.get()
                if bucket is None:
                    return out
                if isinstance(bucket, BaseException):
                    raise bucket
                on_bucket(bucket)
                free.release()
                out.count(bucket)
        finally:  # after an error the taker may be inside a broadcast: it ends with the group
            stop.set()
            free.release()  # a taker waiting for a slab sees the stop

    def _post_bucket(self, header: dict) -> tuple[Bucket, list[Callable[[], None]]]:
        """The bucket of ``header`` in the next slab, and the waits of its bytes' broadcasts."""
        device, sizes = self.spec.device, header["sizes"]
        slab = self._slab(sum(aligned(s) for s in sizes))
        views, works, offset = [], [], 0
        for size in sizes:
            view = slab[offset : offset + size]
            if size:
                into = view if device == "cpu" else torch.empty(size, dtype=torch.uint8, device=device)
                works.append(functools.partial(_landed, _broadcast(self.group, into), into, view))
            views.append(view.numpy())
            offset += aligned(size)
        bucket = Bucket(
            header["entries"], views[0], index=header["index"], sender=header["sender"], part=header["part"],
            last=header["last"], arrays=views[1:],
        )  # fmt: skip
        return bucket, works

    def _post_header(self) -> tuple[Any, torch.Tensor]:
        head = _on(torch.empty(HEADER_BYTES, dtype=torch.uint8), self.spec.device)
        return _broadcast(self.group, head), head

    def _read_header(self, posted: tuple[Any, torch.Tensor]) -> dict | None:
        """The header whose broadcast was posted (`_post_header`); None: the stream ended."""
        work, head = posted
        work.wait()
        head = head.cpu().numpy()
        n = int.from_bytes(head[:8].tobytes(), "little")
        if n == 0:
            return None
        data = head[8 : 8 + min(n, HEADER_BYTES - 8)].tobytes()
        if n > len(data):
            rest = _on(torch.empty(n - len(data), dtype=torch.uint8), self.spec.device)
            _broadcast(self.group, rest).wait()
            data += rest.cpu().numpy().tobytes()
        return pickle.loads(data)

    def _slab(self, nbytes: int) -> torch.Tensor:
        i, self._turn = self._turn, 1 - self._turn
        if self.slabs[i].numel() < nbytes:
            self.slabs[i] = torch.empty(nbytes, dtype=torch.uint8)
        return self.slabs[i]


class StreamThreads:
    """A receiving process's streams, each sender's in a thread of its own (senders stream at once and
    may wait on each other's collectives) handing buckets on under one lock; `wait` joins them and
    raises the first error. Each sender's group is kept from sync to sync (a new key replaces it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.receivers: dict[str, StreamReceiver] = {}
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, stream: BroadcastStream, on_bucket: Callable[[Bucket], Any]) -> None:
        spec = stream.spec
        receiver = self.receivers.get(spec.key)
        if receiver is None:
            for key in [k for k, r in self.receivers.items() if r.spec.sender == spec.sender]:
                del self.receivers[key]  # that sender made a new group
            receiver = self.receivers[spec.key] = StreamReceiver(spec, stream.rank)

        def locked(bucket: Bucket) -> Any:
            with self.lock:
                return on_bucket(bucket)

        def run() -> None:
            try:
                receiver.receive(locked)
            except BaseException as exc:  # handed to `wait`, in the process's own thread
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"weight-stream-{spec.key}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def wait(self, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
        alive = [t.name for t in self.threads if t.is_alive()]
        self.threads = []
        errors, self.errors = self.errors, []
        if errors:
            raise StreamBroken(f"a weight stream broke: {errors[0]}") from errors[0]
        if alive:
            raise StreamBroken(f"weight streams did not end within {timeout_s:.0f} s: {alive}")
