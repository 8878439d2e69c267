"""Weight sync as a stream of buckets into the Megatron engine: bucket size changes nothing, FP8
bytes are what travels, and a sync is complete only when every tensor arrived once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_testing import tiny_recipe

from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.megatron.model import PRECISIONS, build_gpt_model
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.weight_sync.buckets import BucketPacker
from moe_rl.weight_sync.outgoing import Outgoing, owned, sends
from moe_rl.weight_sync.wire import WireEncoder
from tests.unit.weight_sync.sync_testing import detach

pytestmark = pytest.mark.usefixtures("device")


@pytest.fixture(scope="module")
def trainer_model():
    config = tiny_recipe()
    return config, build_gpt_model(config.model, config.parallel, config.trainer, seed=5)


def _buckets(config, model, capacity: int, quantized: bool = True):
    encoder = WireEncoder(config.quant, config.model.num_layers, quantized_wire=quantized)
    outgoing = Outgoing(lambda: owned(model), encoder)  # a trainer rank's, as its sender packs it
    return [detach(b) for b in BucketPacker(capacity).pack(outgoing.groups(capacity))], encoder


def _state(engine: MegatronEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_buckets_of_any_size_load_what_one_whole_sync_loads(trainer_model, precision):
    """Streamed buckets decode straight into the engine's weights, or (q, k, v) into tensors of the
    engine's dtype, and load what a whole sync that decodes to float32 loads."""
    config, model = trainer_model
    assert config.quant.name == "fp8_block128"
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, precision=precision))
    whole = MegatronEngine(config)
    assert next(whole.model.parameters()).dtype == PRECISIONS[precision]
    whole.update_weights(iter_hf_weights(model), version=1)
    buckets, encoder = _buckets(config, model, capacity=2 << 10)
    assert len(buckets) > 5 and all(sends(n) for n, _ in model.named_parameters())
    chunked = {e.name for b in buckets for e in b.entries if "rows" in e.meta}  # larger than a bucket
    assert chunked and all(b.nbytes <= 2 << 10 for b in buckets)
    streamed = MegatronEngine(config)
    streamed.begin_weight_update(1)
    for bucket in buckets:
        streamed.receive_bucket(bucket)
    assert streamed.policy_version == 0  # the version moves only when the last bucket has landed
    streamed.finish_weight_update(1)
    assert streamed.policy_version == 1
    for (name, a), b in zip(_state(whole).items(), _state(streamed).values()):
        assert torch.equal(a, b), name
    # the quantized expert and dense MLP weights were decoded straight into the model (gate and up
    # each into its half of the fused tensor); q, k and v, interleaved in Megatron's tensor, were not
    in_place = streamed._receiver.in_place
    assert any(n.endswith("mlp.experts.0.gate_proj.weight") for n in in_place)
    assert any(n.endswith("mlp.experts.0.down_proj.weight") for n in in_place)
    assert not any("q_proj" in n or "k_proj" in n for n in in_place)
    q_proj = next(n for n in streamed._receiver.dtypes if n.endswith("q_proj.weight"))
    assert streamed._receiver.dtypes[q_proj] == next(whole.model.parameters()).dtype
    assert encoder.report.rel_err == pytest.approx(whole.last_quant_report.rel_err, rel=1e-6)


def test_pieces_of_one_tensor_may_complete_in_different_buckets(trainer_model):
    """bf16 on the wire, 2 KB buckets: q_proj travels in row chunks while k_proj and v_proj travel
    whole in other buckets; Megatron's fused QKV tensor loads once all three have landed, as in a
    whole sync (the pieces that wait are the engine's own copies, not views of a reused bucket)."""
    config, model = trainer_model
    config = dataclasses.replace(config, quant=tiny_recipe("rollout.quant=bf16").quant)
    whole = MegatronEngine(config)
    whole.update_weights(iter_hf_weights(model), version=1)
    buckets, _ = _buckets(config, model, capacity=2 << 10)
    where = {}  # HF name -> the buckets it travelled in
    for i, bucket in enumerate(buckets):
        for entry in bucket.entries:
            where.setdefault(entry.name, set()).add(i)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert len(where[q]) > 1 and not where[k] & where[q]
    streamed = MegatronEngine(config)
    streamed.begin_weight_update(1)
    for bucket in buckets:
        streamed.receive_bucket(bucket)
        bucket.buffer[:] = 0  # the sender reuses the buffer: what waits must not be a view of it
    streamed.finish_weight_update(1)
    for (name, a), b in zip(_state(whole).items(), _state(streamed).values()):
        assert torch.equal(a, b), name


def test_fp8_bytes_travel(trainer_model):
    config, model = trainer_model
    fp8, encoder = _buckets(config, model, capacity=1 << 20)
    full, _ = _buckets(config, model, capacity=1 << 20, quantized=False)
    fp8_bytes, full_bytes = sum(b.nbytes for b in fp8), sum(b.nbytes for b in full)
    entries = [e for b in fp8 for e in b.entries]
    quantized = [e for e in entries if e.dtype == "float8_e4m3fn"]
    assert quantized and all(e.nbytes == e.shape[0] * e.shape[1] for e in quantized)  # 1 byte per weight
    kept = sum(e.nbytes for e in entries if e.dtype == "float32" and "scale" not in e.name)
    scales = sum(e.nbytes for e in entries if e.name.endswith("_scale_inv"))
    assert fp8_bytes == sum(e.nbytes for e in quantized) + kept + scales
    assert fp8_bytes < full_bytes and encoder.report.num_quantized == len(quantized)


def test_an_incomplete_or_repeated_sync_is_refused(trainer_model):
    config, model = trainer_model
    buckets, _ = _buckets(config, model, capacity=2 << 10)
    engine = MegatronEngine(config)
    engine.begin_weight_update(2)
    whole = [i for i, b in enumerate(buckets) if not any("rows" in e.meta for e in b.entries)]
    for i, bucket in enumerate(buckets):
        if i != whole[-1]:
            engine.receive_bucket(bucket)
    with pytest.raises(ValueError, match=r"weight sync incomplete: \d+ of \d+ tensors never arrived"):
        engine.finish_weight_update(2)
    engine.begin_weight_update(2)
    for bucket in buckets[:-1]:  # the last bucket holds the last rows of a chunked weight
        engine.receive_bucket(bucket)
    with pytest.raises(ValueError, match=r"weight sync incomplete: 1 tensor\(s\) arrived in part"):
        engine.finish_weight_update(2)
    engine.begin_weight_update(2)
    engine.receive_bucket(buckets[0])
    with pytest.raises(ValueError, match="arrived twice in one sync"):
        engine.receive_bucket(buckets[0])
    with pytest.raises(ValueError, match="older than the engine's policy version"):
        MegatronEngine(config).begin_weight_update(-1)


def test_a_colocated_sync_by_device_ipc_loads_what_a_whole_sync_loads(trainer_model):
    """A trainer rank that shares its device with the engine (`DeviceIpc`): buckets are packed into
    two buffers of the rank's device memory and only their entries and the buffer's handle travel;
    the engine reads the bytes there and drops its mappings when the sync finishes. Three syncs: the
    second reads the buffers the first shared, rewritten with the weights after an update; before the
    third the rank gives its buffers back (as before a colocated generation), and the third shares
    new ones."""
    import pickle

    from moe_rl.config.modes import SyncRoute
    from moe_rl.config.sync_plan import sync_plan
    from moe_rl.weight_sync import ipc
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import DeviceIpc, Receiver

    config, model = trainer_model
    # the device route (CUDA's) on the CPU: torch shares a CPU buffer through shared memory instead
    plan = dataclasses.replace(sync_plan(config, "cpu"), route=SyncRoute.DEVICE_IPC, bucket_bytes=4 << 10)
    sender = RankSender(model, config.quant, config.model.num_layers, plan)
    engine, sizes = MegatronEngine(config), []
    saved = [p.detach().clone() for p in model.parameters()]  # the module's model, put back at the end

    def deliver(bucket):
        wire = pickle.dumps(bucket)  # as Ray hands it to the engine's process
        sizes.append(len(wire))
        return engine.receive_bucket(pickle.loads(wire))

    try:
        handles = {}
        for version in (1, 2, 3):
            if version > 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.5)
            if version == 3:
                sender.release()
                assert sender.transports[SyncRoute.DEVICE_IPC]._packer is None
            engine.begin_weight_update(version)
            report = sender.send({0: Receiver(deliver)}, timeout_s=10.0)
            engine.finish_weight_update(version)
            assert ipc._OPENED == {}  # the engine holds no mapping of the rank's buffers between syncs
            handles[version] = dict(sender.transports[SyncRoute.DEVICE_IPC]._handles)
            whole = MegatronEngine(config)
            whole.update_weights(iter_hf_weights(model), version=version)
            for (name, a), b in zip(_state(whole).items(), _state(engine).values()):
                assert torch.equal(a, b), (version, name)
            transport = sender.transports[SyncRoute.DEVICE_IPC]
            assert isinstance(transport, DeviceIpc) and report.transports == {"device_ipc"}
            assert report.buckets > 3 and report.shared_memory
        assert max(sizes) < 4096  # entries and a handle, not the bytes
        assert len(handles[1]) == 2 and handles[2] == handles[1]  # two buffers, shared once till released
        assert all(handles[3][slot][1] != handles[1][slot][1] for slot in handles[1])  # new buffers
    finally:
        sender.close()
        with torch.no_grad():
            for p, value in zip(model.parameters(), saved, strict=True):
                p.copy_(value)


def test_what_leaves_a_rank_is_the_model_as_it_is_cast_only_to_an_engines_dtype(trainer_model):
    """One rank, no parallel groups: it sends every tensor (`sends`). `owned` and `whole_model`
    hand out the model's own storage where a weight needs no change (no copy of a large model is
    made), the same names and values; with an engine's dtype every floating tensor is cast to it,
    except the expert-score bias vLLM keeps in float32 (`engine_dtype`)."""
    from moe_rl.weight_sync.outgoing import SyncPart, engine_dtype, whole_model

    _, model = trainer_model
    assert all(sends(n) for n, _ in model.named_parameters())
    storages = {p.data.untyped_storage().data_ptr() for p in model.parameters()}
    mine = [pair for group in owned(model) for pair in group]
    whole = [pair for group in whole_model(model) for pair in group]
    assert [n for n, _ in whole] == [n for n, _ in mine] and len(mine) > 10
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, whole))
    for pairs in (mine, whole):  # the embedding (and every norm) leaves as a view of its parameter
        views = {n for n, t in pairs if t.untyped_storage().data_ptr() in storages}
        assert "model.embed_tokens.weight" in views, sorted(views)
    cast = [pair for group in whole_model(model, torch.bfloat16, "cpu", part=SyncPart()) for pair in group]
    assert [n for n, _ in cast] == [n for n, _ in mine]
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, m.to(torch.bfloat16))
        for (_, t), (_, m) in zip(cast, mine)
    )
    bias, weight = torch.full((4,), 0.1, dtype=torch.float64), torch.ones(2, 2)
    assert (
        engine_dtype("model.layers.1.mlp.gate.e_score_correction_bias", bias, torch.bfloat16).dtype
        == torch.float32
    )
    assert engine_dtype("model.layers.1.mlp.gate.weight", weight, torch.bfloat16).dtype == torch.bfloat16
    index = torch.arange(3)
    assert engine_dtype("x.e_score_correction_bias", index, torch.bfloat16) is index  # integers as they are
    assert engine_dtype("x.weight", index, torch.bfloat16) is index


def test_an_expert_parallel_ranks_experts_are_named_by_their_global_index():
    """`whole_model` at EP > 1 renames the experts gathered from each expert-parallel rank: rank r
    holds ``local`` consecutive experts from ``r * local``, each as the same local index as here."""
    import dataclasses as dc
    from types import SimpleNamespace

    from moe_rl.weight_sync.outgoing import SyncPart, _num_experts, _peer_expert

    name = "model.layers.1.mlp.experts.5.down_proj.weight"  # local index 1 of rank 1 (4 per rank)
    assert [_peer_expert(name, rank, 4) for rank in range(3)] == [
        f"model.layers.1.mlp.experts.{i}.down_proj.weight" for i in (1, 5, 9)
    ]
    assert (
        _peer_expert("model.layers.0.mlp.experts.2.up_proj.weight", 2, 3)
        == "model.layers.0.mlp.experts.8.up_proj.weight"
    )
    with pytest.raises(ValueError, match="is not an expert's weight"):
        _peer_expert("model.layers.1.mlp.gate.weight", 1, 4)
    moe = SimpleNamespace(config=SimpleNamespace(num_moe_experts=8))
    assert _num_experts(SimpleNamespace(module=SimpleNamespace(module=moe))) == 8  # through wrappers
    assert _num_experts(SimpleNamespace(config=SimpleNamespace(num_moe_experts=None))) == 1  # dense
    with pytest.raises(dc.FrozenInstanceError):
        SyncPart().adapters = True  # type: ignore[misc]


def test_without_parallel_groups_a_process_sends_every_tensor(trainer_model):
    """A process that never set up Megatron's groups (a tool reading a model) is its own only rank."""
    from megatron.core import parallel_state as ps

    from moe_rl.megatron.parallel import init_parallel, teardown_parallel

    config, model = trainer_model
    names = [n for n, _ in model.named_parameters()]
    assert any(".mlp.experts." in n for n in names) and any(".self_attention." in n for n in names)
    teardown_parallel()
    try:
        assert not ps.model_parallel_is_initialized()
        assert all(sends(n) for n in names)
    finally:
        init_parallel(config.parallel)
