"""A CPU trainer's parameters in a shared arena: tensors that travel as they are are read by the
receivers where the trainer holds them (not copied into a slot), the rest still goes through the
slots, and the trainer's optimizer keeps working on the moved parameters."""

from __future__ import annotations

import pickle

import pytest
import torch

from moe_rl.device import PARALLEL_COPY_BYTES, copy_into
from moe_rl.weight_sync import shm
from moe_rl.weight_sync.buckets import BucketPacker
from moe_rl.weight_sync.sender import share_parameters
from moe_rl.weight_sync.wire import LazyGroup, Piece
from tests.unit.weight_sync.sync_testing import detach, in_another_process, lazy


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)  # this test's own folder, not the machine's /dev/shm
    monkeypatch.setattr(shm, "_MAPPED", {})
    return tmp_path


def _received(bucket) -> dict[str, torch.Tensor]:
    """The bucket as a receiver in another process would get it: pickled, then read in place."""
    wire = pickle.dumps(bucket)
    assert len(wire) < 2048, "an in-place bucket must travel without its bytes"
    shm._MAPPED.clear()
    return {e.name: t.clone() for e, t in pickle.loads(wire).tensors()}


def test_the_arena_places_tensors_and_locates_only_what_lies_wholly_in_it(shm_dir):
    arena = shm.SharedArena(1024, tag="t")
    a = arena.place(torch.arange(10, dtype=torch.float32))
    b = arena.place(torch.ones(3, 4, dtype=torch.bfloat16))
    assert torch.equal(a, torch.arange(10, dtype=torch.float32)) and b.dtype == torch.bfloat16
    ref_a, ref_b = arena.locate(a), arena.locate(b)
    assert (ref_a.offset, ref_a.nbytes) == (0, 40)
    assert ref_b.offset == shm.ALIGN and ref_b.nbytes == 24  # aligned
    assert arena.locate(a[2:5]).offset == 8  # a contiguous part of a placed tensor
    assert arena.locate(b.t()) is None  # not contiguous
    assert arena.locate(torch.arange(10, dtype=torch.float32)) is None  # elsewhere
    assert arena.locate(torch.empty(0)) is None
    with pytest.raises(ValueError, match="would end at"):
        arena.place(torch.zeros(1000))
    assert torch.equal(torch.from_numpy(shm.read_slot(ref_a).copy()).view(torch.float32), a)
    arena.close()
    assert list(shm_dir.iterdir()) == [] and float(a.sum()) == 45.0  # the placed tensors outlive the file


def test_a_packer_sends_arena_tensors_where_they_lie_and_writes_the_rest(shm_dir):
    arena = shm.SharedArena(4096, tag="t")
    held = arena.place(torch.arange(16, dtype=torch.float32))
    other = torch.arange(8, dtype=torch.float32) + 100  # not in the arena (e.g. a gathered shard)
    computed = torch.full((4,), 7.0)  # written by the encoder (e.g. quantized bytes)
    written: list[str] = []

    def fill(views):
        assert views[0] is None  # the packer reads `held` in place: nothing to write
        for view, value, name in ((views[1], other, "other"), (views[2], computed, "computed")):
            copy_into(view, value)
            written.append(name)

    group = LazyGroup(
        [
            Piece("held", held.dtype, tuple(held.shape), {}, held),
            Piece("other", other.dtype, tuple(other.shape), {}, other),
            Piece("computed", torch.float32, (4,), {}),
        ],
        fill,
    )
    slots = shm.SharedSlots(256, tag="t")
    packer = BucketPacker(256, slots=slots, arena=arena)
    (bucket,) = packer.pack(iter([group]))
    assert written == ["other", "computed"]
    by_name = {e.name: e for e in bucket.entries}
    assert by_name["held"].source.path == arena.path and by_name["other"].source is None
    assert bucket.slot.nbytes == 128 and bucket.nbytes == 112  # only other, computed (aligned) in the slot
    got = _received(bucket)
    assert torch.equal(got["held"], held) and torch.equal(got["other"], other)
    assert torch.equal(got["computed"], computed)
    kept = detach(bucket)  # a copy of every byte, the arena's included
    held.add_(1)
    assert all(e.source is None for e in kept.entries)
    assert torch.equal(dict((e.name, t) for e, t in kept.tensors())["held"], held - 1)
    slots.close()
    arena.close()
    with pytest.raises(ValueError, match="only with shared slots"):
        BucketPacker(256, arena=arena)


def test_in_place_buckets_count_their_bytes_toward_parts_and_buckets(shm_dir):
    from moe_rl.weight_sync.transport import publish

    arena = shm.SharedArena(4096, tag="t")
    tensors = [arena.place(torch.full((8,), float(i))) for i in range(5)]  # 32 B each
    slots = shm.SharedSlots(64, tag="t")
    packer = BucketPacker(64, slots=slots, part_bytes=32, arena=arena)
    groups = [[(f"w{i}", t, {})] for i, t in enumerate(tensors)]
    delivered = []
    out = publish(packer.pack(lazy(groups)), {0: lambda b: delivered.append(b) or len(delivered)}, 1.0)
    assert (out.bytes, out.in_place, out.buckets) == (160, 160, 3)
    assert [(b.index, b.part, b.last) for b in delivered] == [(0, 0, False), (0, 1, True), (1, 0, False),
                                                            (1, 1, True), (2, 0, True)]  # fmt: skip
    assert all(b.slot.nbytes == 0 for b in delivered)
    got = {}
    for bucket in delivered:
        got |= _received(bucket)
    assert all(torch.equal(got[f"w{i}"], t) for i, t in enumerate(tensors))
    slots.close()
    arena.close()


def test_share_parameters_moves_a_model_in_place_and_training_goes_on(shm_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model[1].weight = torch.nn.Parameter(model[0].weight.data.t().contiguous())
    flat = torch.zeros(12)
    model.register_parameter("in_buffer", torch.nn.Parameter(flat[4:]))  # a view into a flat buffer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    arena = share_parameters(model, tag="t")
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
        assert (arena.locate(param) is not None) == (name != "in_buffer"), name
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    moved = model[0].weight
    assert not torch.equal(moved, before["0.weight"])
    ref = arena.locate(moved)
    code = "from moe_rl.weight_sync.shm import read_slot\n"
    code += "print(float(torch.from_numpy(read_slot(sent).copy()).view(torch.float32).sum()))"
    total = in_another_process(code, ref)
    assert total == pytest.approx(float(moved.detach().sum()), rel=1e-6)  # another process sees the step
    arena.close()
    assert share_parameters(torch.nn.Linear(2, 2, device="meta")) is None


def test_share_parameters_moves_only_what_the_rank_sends(shm_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    arena = share_parameters(model, tag="t", select=lambda name: name.startswith("1."))
    assert {n for n, p in model.named_parameters() if arena.locate(p) is not None} == {"1.weight", "1.bias"}
    arena.close()
    before = [p.data_ptr() for p in model[0].parameters()]
    assert share_parameters(model[0], tag="u", select=lambda name: False) is None  # sends nothing
    assert [p.data_ptr() for p in model[0].parameters()] == before


def test_no_arena_without_room_in_shared_memory(shm_dir, monkeypatch, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    monkeypatch.setattr(shm, "slot_dir", lambda nbytes: disk)  # /dev/shm too small: a file on disk
    model = torch.nn.Linear(4, 4)
    before = model.weight.data_ptr()
    assert share_parameters(model) is None
    assert model.weight.data_ptr() == before and list(disk.iterdir()) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_into_copies_large_tensors_on_several_threads(threads):
    n = PARALLEL_COPY_BYTES // 2 + 7  # bf16: just over the threshold, not a multiple of the threads
    source = torch.randn(n).to(torch.bfloat16)
    target = torch.zeros_like(source)
    copy_into(target, source, threads=threads)
    assert torch.equal(target, source)
