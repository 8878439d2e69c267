"""Buckets through the sender's shared-memory slots: only entries and a slot name travel, receivers
read the bytes in place, slots are reused every other bucket, grown under a new name, and removed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.weight_sync import shm
from moe_rl.weight_sync.buckets import SLACK, Bucket, BucketPacker, aligned
from tests.unit.weight_sync.sync_testing import in_another_process, lazy


@pytest.fixture
def slots(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)  # this test's own folder, not the machine's /dev/shm
    monkeypatch.setattr(shm, "_MAPPED", {})
    slots = shm.SharedSlots(64, tag="t")
    yield slots
    slots.close()


def _groups(sizes: list[int]):
    return [[(f"w{i}", torch.arange(n, dtype=torch.float32) + 1000 * i, {})] for i, n in enumerate(sizes)]


def _received(bucket: Bucket) -> dict[str, torch.Tensor]:
    """The bucket as a receiver gets it: pickled (as Ray sends it), then read from the slot."""
    wire = pickle.dumps(bucket)
    assert len(wire) < 1024, "a shared-slot bucket must travel without its bytes"
    shm._MAPPED.clear()  # a receiver maps the slot itself
    return {e.name: t.clone() for e, t in pickle.loads(wire).tensors()}


def test_buckets_alternate_between_two_slots_and_arrive_intact(slots, tmp_path):
    packer = BucketPacker(64, slots=slots)
    groups = _groups([16, 16, 16, 8])  # 64 B, 64 B, 64 B, 32 B: a bucket each
    paths = []
    for bucket, group in zip(packer.pack(lazy(groups)), groups, strict=True):
        assert bucket.slot is not None and bucket.slot.nbytes == aligned(bucket.nbytes)
        paths.append(bucket.slot.path)
        got = _received(bucket)
        assert torch.equal(got[group[0][0]], group[0][1])
    assert paths[0] == paths[2] and paths[1] == paths[3] and paths[0] != paths[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({Path(p).name for p in paths})
    assert slots.nbytes() == 2 * (64 + SLACK)  # room for the padding of tensors written in a bucket


def test_an_oversized_group_gets_a_larger_slot_under_a_new_name(slots, tmp_path):
    packer = BucketPacker(64, slots=slots)
    first = next(packer.pack(lazy(_groups([8]))))
    old = first.slot.path
    _received(first)
    big = next(packer.pack(lazy(_groups([1100]))))  # 4400 B > 64 B + SLACK: slot 0 replaced
    assert big.slot.path != old and not Path(old).exists() and big.nbytes == 4400
    assert torch.equal(_received(big)["w0"], torch.arange(1100, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="is gone"):
        shm.read_slot(shm.SlotRef(old, 32))


def test_close_removes_the_files_and_stale_ones_of_dead_senders_go(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"{shm.PREFIX}{int(dead.stdout)}-0-0-1"
    stale.write_bytes(b"x" * 10)
    mine = tmp_path / f"{shm.PREFIX}{os.getpid()}-other-0-1"  # a live sender's: kept
    mine.write_bytes(b"y")
    slots = shm.SharedSlots(32)
    slots.buffer(0, 8)
    assert not stale.exists() and mine.exists()
    assert len(list(tmp_path.glob(f"{shm.PREFIX}{os.getpid()}-0-*"))) == 1
    slots.close()
    assert list(tmp_path.glob(f"{shm.PREFIX}{os.getpid()}-0-*")) == []
    with pytest.raises(ValueError, match="capacity > 0"):
        shm.SharedSlots(0)


def test_another_process_reads_the_bucket_in_place(slots):
    bucket = next(BucketPacker(64, slots=slots).pack(lazy(_groups([12]))))
    total = in_another_process("print(sum(float(t.sum()) for _, t in sent.tensors()))", bucket)
    assert total == float(torch.arange(12, dtype=torch.float32).sum())


def test_a_new_sender_never_reuses_a_file_name_a_receiver_may_have_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    monkeypatch.setattr(shm, "_MAPPED", {})
    first = shm.SharedSlots(32)
    bucket = next(BucketPacker(32, slots=first).pack(lazy(_groups([4]))))
    assert float(next(bucket.tensors())[1].sum()) == 6.0
    shm.read_slot(bucket.slot)  # mapped by this "receiver"
    first.close()
    second = shm.SharedSlots(32)  # same tag, same process: a new name all the same
    again = next(BucketPacker(32, slots=second).pack(lazy([[("w", torch.full((4,), 7.0), {})]])))
    assert again.slot.path != bucket.slot.path
    assert torch.equal(_received(again)["w"], torch.full((4,), 7.0))
    second.close()


def test_a_bucket_in_a_slot_travels_in_parts_of_whole_groups(slots):
    packer = BucketPacker(64, slots=slots, part_bytes=24)
    groups = _groups([4, 4, 4, 2, 12])  # 16 B, 16 B, 16 B, 8 B, 48 B: buckets of 56 B and 48 B
    parts = list(packer.pack(lazy(groups)))
    assert [(p.index, p.part, p.last) for p in parts] == [(0, 0, False), (0, 1, True), (1, 0, True)]
    assert [[e.name for e in p.entries] for p in parts] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [(p.slot.offset, p.slot.nbytes) for p in parts] == [(0, 128), (128, 128), (0, 64)]  # aligned
    assert parts[0].slot.path == parts[1].slot.path != parts[2].slot.path
    got = {}
    for part in parts:
        assert part.entries[0].offset == 0  # offsets count from the part's first byte
        got |= _received(part)
    for ((name, tensor, _),) in groups:
        assert torch.equal(got[name], tensor)


def test_a_bucket_without_slots_travels_whole():
    packer = BucketPacker(64, part_bytes=8)
    parts = [(b.index, b.part, b.last, b.nbytes) for b in packer.pack(lazy(_groups([4, 4, 4, 4, 2])))]
    assert parts == [(0, 0, True, 64), (1, 0, True, 8)]


def test_publish_frees_a_slot_only_after_every_part_of_its_bucket_was_delivered(slots, monkeypatch):
    from moe_rl.weight_sync import transport

    events: list = []
    monkeypatch.setattr(
        transport,
        "settle",
        lambda flight, timeout: events.append(("settle", [ref for _, ref in flight])) or set(),
    )
    packer = BucketPacker(32, slots=slots, part_bytes=16)

    def deliver(bucket):
        events.append(("deliver", (bucket.index, bucket.part)))
        return (bucket.index, bucket.part)

    out = transport.publish(packer.pack(lazy(_groups([4, 4, 4, 4, 4, 4, 4]))), {0: deliver}, 1.0)
    assert (out.buckets, out.bytes) == (4, 112)
    assert events == [
        ("deliver", (0, 0)), ("deliver", (0, 1)), ("settle", []),
        ("deliver", (1, 0)), ("deliver", (1, 1)), ("settle", [(0, 0), (0, 1)]),  # before bucket 2 reuses slot 0
        ("deliver", (2, 0)), ("deliver", (2, 1)), ("settle", [(1, 0), (1, 1)]),
        ("deliver", (3, 0)), ("settle", [(2, 0), (2, 1)]),
        ("settle", [(3, 0)]),
    ]  # fmt: skip
