"""Buckets in a sender's device buffers (`DeviceIpc`): only entries and the buffer's IPC handle
travel, another process reads the same memory (on CPU, torch's shared-memory files; on CUDA the
same code shares the allocation by CUDA IPC), the two buffers alternate and keep their handles, and
a grown buffer is shared again under a new one."""

from __future__ import annotations

import pickle

import pytest
import torch

from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.transport import DeviceIpc, Published, handed
from tests.unit.weight_sync.sync_testing import in_another_process, lazy

READ = "print(float(sum(t.double().sum() for _, t in sent.tensors())))"
"""What a receiver in another process reads of the bucket it was sent."""


def _groups(values: list[float], n: int = 16):
    return [[(f"w{i}", torch.full((n,), v), {})] for i, v in enumerate(values)]


def _messages(transport: DeviceIpc, groups) -> list:
    """What the receiver is handed, bucket by bucket (`handed`, as `publish` delivers)."""
    out: list = []
    for _ in handed(transport.packer.pack(lazy(groups)), {0: out.append}, 1.0, transport, Published()):
        pass
    return out


def test_buckets_travel_as_handles_and_another_process_reads_the_senders_memory():
    transport = DeviceIpc(64, sender=3)
    try:
        first = _messages(transport, _groups([1.0, 2.0, 3.0]))
        assert [m.ipc.key[1:] for m in first] == [(3, 0), (3, 1), (3, 0)]  # two buffers, alternating
        assert all(m.buffer is None and m.slot is None for m in first)
        wire = [pickle.dumps(m) for m in first]
        assert max(len(w) for w in wire) < 2048, "a device bucket must travel without its bytes"
        # a fresh process maps the sender's buffer and reads the bucket where it lies
        assert in_another_process(READ, pickle.loads(wire[1])) == 2.0 * 16
        handles = dict(transport._handles)
        again = _messages(transport, _groups([5.0, 6.0]))  # the next sync rewrites the same buffers
        assert transport._handles == handles and again[0].ipc.handle == first[0].ipc.handle
        assert in_another_process(READ, again[0]) == 5.0 * 16
        got = pickle.loads(pickle.dumps(again[1]))  # this process reads it through the handle too
        assert torch.equal(dict((e.name, t) for e, t in got.tensors())["w1"], torch.full((16,), 6.0))
        big = _messages(transport, _groups([7.0], n=2000))  # beyond a buffer and its slack: shared anew
        assert big[0].ipc.handle != first[0].ipc.handle and big[0].ipc.nbytes == 8000
        assert in_another_process(READ, big[0]) == 7.0 * 2000
    finally:
        transport.close()


def test_a_reference_past_its_buffer_and_a_view_are_refused(monkeypatch):
    monkeypatch.setattr(ipc, "_OPENED", {})  # this test's mappings only
    buffer = torch.zeros(32, dtype=torch.uint8)
    handle = ipc.share(buffer)
    with pytest.raises(RuntimeError, match="holds 32 bytes, the bucket ends at 48"):
        ipc.open_ref(ipc.IpcRef(handle, ("test", 0), 16, 32))
    with pytest.raises(ValueError, match="only a whole contiguous buffer"):
        ipc.share(torch.zeros(8, dtype=torch.uint8)[2:])


READ_LAST = "for m in sent[:-1]:\n    list(m.tensors())\nsent = sent[-1]\n" + READ
"""A receiver in another process maps the buffers of the buckets before the last, then reads the last."""


def test_a_receiver_maps_a_grown_buffer_of_the_same_slot_anew():
    transport = DeviceIpc(64, sender=4)
    try:
        old = _messages(transport, _groups([1.0, 2.0, 3.0]))[2]  # slot 0 of the first sync: 3.0s
        kept = transport.packer.buffers[0]  # the old buffer lives on for the receiver to map first
        # 7.0 x 2000 floats outgrow slot 0's buffer (64 + SLACK bytes), 8.0 goes to slot 1, then
        # 9.0 to slot 0 again: its 16 floats at offset 0 of the grown buffer
        new = _messages(transport, [[("big", torch.full((2000,), 7.0), {})], *_groups([8.0, 9.0])])
        assert transport.packer.buffers[0] is not kept and new[2].ipc.key == old.ipc.key
        assert (new[2].ipc.offset, new[2].ipc.nbytes) == (old.ipc.offset, old.ipc.nbytes) == (0, 64)
        # the receiver's mapping of slot 0 held 3.0s there: it must read 9.0 x 16 = 144 now
        assert in_another_process(READ_LAST, [old, new[2]]) == 9.0 * 16
    finally:
        transport.close()


def test_a_new_transport_of_the_same_sender_is_mapped_anew_after_close():
    first = DeviceIpc(64, sender=5)
    old = _messages(first, _groups([1.0]))[0]
    kept = first.packer.buffers[0]  # the old buffer lives on for the receiver to map first
    first.close()
    second = DeviceIpc(64, sender=5)  # same process, same sender: the same key for slot 0
    try:
        new = _messages(second, _groups([4.0]))[0]
        assert new.ipc.key == old.ipc.key and new.ipc.handle != old.ipc.handle
        assert second.packer.buffers[0] is not kept
        # the receiver mapped the closed transport's buffer (1.0s): it must read 4.0 x 16 = 64 now
        assert in_another_process(READ_LAST, [old, new]) == 4.0 * 16
    finally:
        second.close()


def test_a_released_transport_frees_its_buffers_and_the_next_sync_shares_new_ones(monkeypatch):
    """Before a colocated generation a trainer rank gives back its two buffers (`DeviceIpc.release`),
    once its receivers dropped their mappings at the end of their sync (`ipc.close_opened`); the next
    sync packs into new buffers, shares them anew, and a receiver reads the new bytes."""
    monkeypatch.setattr(ipc, "_OPENED", {})  # this test's mappings only
    transport = DeviceIpc(64, sender=6)
    try:
        old = _messages(transport, _groups([1.0, 2.0]))
        assert [sum(t.sum() for _, t in pickle.loads(pickle.dumps(m)).tensors()) for m in old] == [16.0, 32.0]
        assert set(ipc._OPENED) == {m.ipc.key for m in old}  # this process mapped both slots
        ipc.close_opened()
        assert ipc._OPENED == {}
        buffers = transport.packer.buffers
        transport.release()
        assert transport._packer is None and transport._handles == {}
        new = _messages(transport, _groups([3.0, 4.0]))
        assert all(b is not c for b, c in zip(buffers, transport.packer.buffers, strict=True))
        assert [m.ipc.key for m in new] == [m.ipc.key for m in old]
        assert all(n.ipc.handle != o.ipc.handle for n, o in zip(new, old, strict=True))
        assert in_another_process(READ_LAST, new) == 4.0 * 16
    finally:
        transport.close()
