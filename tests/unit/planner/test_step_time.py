"""The step-time model (`moe_rl.planner.step_time`): every phase of a hand-sized MoE against a hand
count, the overlap of an asynchronous step, the sync's route and link, the chip a recipe names, and
the refusals (an unknown chip, a factor out of range, a KV cache that holds no sequence)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_recipe
from moe_rl.config.modes import GpuType, SyncRoute
from moe_rl.config.schema import ClusterConfig
from moe_rl.config.sync_plan import SyncPlan, sync_plan
from moe_rl.planner.flops import count_params
from moe_rl.planner.memory import rollout_memory, rollout_weight_bytes
from moe_rl.planner.step_time import (
    FITTED,
    MACHINES,
    Efficiency,
    Limit,
    PhaseCannotRun,
    allreduce_latency_us,
    allreduce_seconds,
    alltoall_seconds,
    experts_touched,
    gather_gbps,
    gathered_sync_cost,
    machine_of,
    model_parallel_span,
    resharded_sync_cost,
    step_time,
    sync_cost,
)

# relative only: the hand model's seconds are as small as 1e-11, below pytest.approx's default
# absolute tolerance (1e-12), which would hide an error of a few percent
approx = functools.partial(pytest.approx, rel=1e-6, abs=0)

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
ONE = Efficiency(1.0, 1.0, 1.0)

# vocab 16, hidden 8, 2 layers of 2 heads of 4 (1 KV head), 4 experts top-1 of width 2, untied head.
HAND_MODEL = [
    "model.vocab_size=16", "model.hidden_size=8", "model.num_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=4", "model.moe_ffn_hidden_size=2", "model.num_experts=4",
    "model.moe_router_topk=1", "model.ffn_hidden_size=16",
]  # fmt: skip
# one node of 8 H100 (auto from 80 GiB), 2 engines of TP 1, 8 samples (4 prompts of 2), prompts up to
# 10 and responses up to 20 tokens, the mean half of each; nothing released between phases.
HAND_CLUSTER = [
    "cluster.gpus_per_node=8", "cluster.gpu_memory_gib=80", "cluster.release_memory=off",
    "parallel.trainer_world_size=8", "rollout.quant=bf16", "rollout.batch_size=8", "rollout.group_size=2",
    "rollout.num_engines=2", "rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.5",
    "data.max_prompt_len=10", "rollout.max_new_tokens=20", "cluster.mean_length_fraction=0.5",
    "trainer.num_mini_batches=1", "algo.kl.coef=0", "run.device=cuda",
]  # fmt: skip
H100_BF16, H100_HBM, H100_NVLINK = 989e12, 3350e9, 450e9
# Hand counts of the model: parameters 128 (embedding) + 128 (head) + 8 (final norm) + 2 layers of
# (200 attention with q/k norms + 16 norms + 32 router + 4 experts of 48) = 1,144, bf16 2,288 bytes,
# the experts 768 bytes, the input embedding 256. Forward FLOPs per token: attention 2*2*192, router
# 2*2*8*4, one expert 2*2*48, output 2*8*16 = 1,344; per causal pair 2*2*(2*2*4) = 64. KV cache per
# token: K and V of 2 layers x 1 head x 4 in bf16 = 32 bytes.
PARAMS, WEIGHT_BYTES, EXPERT_BYTES, EMBEDDING_BYTES = 1144, 2288, 768, 256
PER_TOKEN, PER_PAIR, KV_TOKEN = 1344, 64, 32


def _hand(*overrides: str):
    return load_recipe(RECIPES / "tiny_moe.yaml", [*HAND_MODEL, *HAND_CLUSTER, *overrides])


def _step(config, efficiency=ONE, released: float = 0.0):
    return step_time(config, sync_plan(config, "cuda"), released, efficiency)


def test_the_hand_model_counts_as_the_hand_count():
    config = _hand()
    counts = count_params(config.model)
    assert counts.total == PARAMS
    assert rollout_weight_bytes(config, counts) == WEIGHT_BYTES


def test_experts_touched_by_a_batch():
    assert experts_touched(4, 1, 1) == 1.0
    assert experts_touched(4, 1, 2) == approx(4 * (1 - 0.75**2))  # 1.75
    assert experts_touched(8, 2, 0) == 0.0
    assert experts_touched(0, 0, 64) == 0.0
    assert experts_touched(256, 8, 10_000) == approx(256)


def test_generation_by_hand():
    """4 samples per engine (2 prompts of 2), one wave (the KV cache holds them all), 20 decode steps
    (the longest response) with 4 * 10/20 = 2 sequences in flight on average."""
    t = _step(_hand())
    # prefill: 4 samples x (5 tokens x 1,344 + 5*6/2 pairs x 64) at the bf16 peak
    assert t.phase("prefill").seconds == approx(4 * (5 * PER_TOKEN + 15 * PER_PAIR) / H100_BF16)
    assert t.phase("prefill").bound == Limit.COMPUTE
    # a step reads the weights but the input embedding and all but the touched share of the experts
    touched = 1 - 0.75**2  # 2 tokens, top-1 of 4
    per_step = WEIGHT_BYTES - EXPERT_BYTES - EMBEDDING_BYTES + touched * EXPERT_BYTES
    assert per_step == 1600
    # each sample reads its KV cache at every step: p*r + r^2/2 = 5*10 + 50 token reads
    kv = 4 * (5 * 10 + 10**2 / 2) * KV_TOKEN
    decode = t.phase("decode")
    assert decode.seconds == approx((20 * per_step + kv) / H100_HBM)
    assert decode.bound == Limit.MEMORY
    assert "20 steps, 2 sequences in flight (1 wave(s) of 4)" in decode.detail


def test_decode_is_compute_bound_on_the_cpu():
    """The tiny recipe on the CPU machine (its measured fp32 rate): 64 samples, prompts of
    0.6 x 16 and responses of 0.6 x 8 tokens. Per token 2 layers x 2 x (q, k, v, o: 3 x 4,096
    multiply-adds) + router 2 x 2 x 64 x 8 + 2 experts 2 x 2 x 2 x 12,288 + output 2 x 64 x 16 =
    151,552 FLOPs; per pair 2 x 2 x 2 x 4 x 16 = 512."""
    config = load_recipe(RECIPES / "tiny_moe.yaml")
    t = step_time(config, sync_plan(config, "cpu"), 0.0, ONE)
    p, r = 0.6 * 16, 0.6 * 8
    flops = 64 * (r * 151_552 + (p * r + r**2 / 2) * 512)
    decode = t.phase("decode")
    assert decode.bound == Limit.COMPUTE
    assert decode.seconds == approx(flops / (MACHINES[GpuType.CPU].fp32_tflops * 1e12))


def test_waves_when_the_kv_cache_holds_fewer_sequences_than_an_engine_has():
    """256 samples per engine of a model whose KV cache holds 40 sequences at the mean length: 7
    waves, each lasting the longest response."""
    config = load_recipe(
        RECIPES / "qwen3_30b_a3b.yaml", ["rollout.num_engines=2", "rollout.gpu_memory_utilization=0.5"]
    )  # fmt: skip
    counts = count_params(config.model)
    kv_tokens = rollout_memory(config, counts).kv_tokens
    mean = 0.6 * (2048 + 8192)
    wave = int(kv_tokens // mean)
    n = 256
    waves = -(-n // wave)
    t = step_time(config, sync_plan(config, "cuda"), 0.0, ONE)
    assert 1 < waves < n
    assert f"{waves * 8192:,} steps" in t.phase("decode").detail
    assert f"({waves} wave(s) of {wave})" in t.phase("decode").detail


@pytest.mark.parametrize(("depth", "in_flight", "steps"), [(2, 8, 5), (3, 12, 4)])
def test_continuous_batching_keeps_the_wave_full(depth, in_flight, steps):
    """``depth`` steps ahead on nodes of their own the engine holds the prompts of ``depth``
    batches (4 samples each; its KV cache holds far more) and the next batch fills finished places:
    ceil(n * r / b) steps of b sequences, instead of the longest response per wave."""
    config = _hand(
        "cluster.nodes=2", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1", "run.mode=async",
        f"run.async_depth={depth}", f"run.max_staleness={depth}",
    )  # fmt: skip
    t = _step(config)
    per_step = WEIGHT_BYTES - EXPERT_BYTES - EMBEDDING_BYTES + (1 - 0.75**in_flight) * EXPERT_BYTES
    kv = 4 * (5 * 10 + 50) * KV_TOKEN
    assert t.phase("decode").seconds == approx((steps * per_step + kv) / H100_HBM)  # ceil(4 * 10 / b)
    assert f"{steps} steps, {in_flight} sequences in flight (continuous batching)" in t.phase("decode").detail


def test_continuous_batching_is_bounded_by_the_kv_cache():
    """Qwen3-30B-A3B, 8 engines of TP 2 on 16 H100 at 0.8 of the memory, 256 samples each and 64
    batches ahead: the engine holds what its KV cache holds at the mean length, not 64 x 256."""
    config = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", [
        "cluster.nodes=4", "cluster.trainer_nodes=2", "cluster.rollout_nodes=2", "rollout.num_engines=8",
        "rollout.tensor_parallel_size=2", "rollout.batch_size=2048", "rollout.gpu_memory_utilization=0.8",
        "run.mode=async", "run.async_depth=64", "run.max_staleness=64",
    ])  # fmt: skip
    held = int(rollout_memory(config, count_params(config.model)).kv_tokens // (0.6 * (2048 + 8192)))
    assert 0 < held < 256
    t = step_time(config, sync_plan(config, "cuda"), 0.0, ONE)
    steps = math.ceil(256 * 0.6 * 8192 / held)
    assert f"{steps:,} steps, {held} sequences in flight" in t.phase("decode").detail


def test_trainer_passes_by_hand():
    """8 sequences of the mean length 15: per token 1,344 FLOPs, 15*16/2 pairs each of 64; π_old and
    the reference once, training three times, over 8 GPUs at the bf16 peak and the MFU."""
    forward = 8 * 15 * PER_TOKEN + 8 * (15 * 16 // 2) * PER_PAIR
    assert forward == 222_720
    t = _step(_hand("algo.kl.coef=0.01", "trainer.precision=bf16"), Efficiency(1.0, 0.5, 1.0))
    rate = 8 * H100_BF16 * 0.5
    assert t.phase("π_old").seconds == approx(forward / rate)
    assert t.phase("reference").seconds == approx(forward / rate)
    assert t.phase("training").seconds == approx(3 * forward / rate)
    without = _step(_hand(), Efficiency(1.0, 0.5, 1.0))
    assert [p.name for p in without.phases].count("reference") == 0
    fp32 = _step(_hand("trainer.precision=fp32"), Efficiency(1.0, 0.5, 1.0))  # TF32 tensor cores
    assert fp32.phase("π_old").seconds == approx(forward / (8 * 494.5e12 * 0.5))


def test_lora_skips_the_frozen_weights_gradients_by_hand():
    """With LoRA the backward computes no gradient for the frozen weights: of the 1,344 FLOPs a token
    of weight products (the output layer's 2·16·8 = 256 of them) one forward's worth less; the
    attention pairs' backward stays. With the output layer trained, its 256 keep theirs."""
    tokens, pairs = 8 * 15, 8 * (15 * 16 // 2) * PER_PAIR
    forward = tokens * PER_TOKEN + pairs
    rate = 8 * H100_BF16 * 0.5
    lora = _step(_hand("lora.rank=4", "trainer.precision=bf16"), Efficiency(1.0, 0.5, 1.0))
    assert lora.phase("training").seconds == approx((3 * forward - tokens * PER_TOKEN) / rate)
    assert lora.phase("π_old").seconds == approx(forward / rate)
    head = _step(
        _hand("lora.rank=4", "lora.train_output_layer=true", "trainer.precision=bf16"),
        Efficiency(1.0, 0.5, 1.0),
    )
    assert head.phase("training").seconds == approx((3 * forward - tokens * (PER_TOKEN - 2 * 16 * 8)) / rate)


def test_an_adapter_only_sync_moves_what_trains():
    """`lora.sync=adapters`: after an engine took the base, a step's sync moves the adapters alone,
    in the trainer's bf16, through the same link as the whole model's (the hand model's 1,144
    parameters in fp32 otherwise)."""
    from moe_rl.planner.flops import lora_param_counts

    merged = _hand("lora.rank=4", "trainer.precision=bf16")
    adapters = _hand("lora.rank=4", "trainer.precision=bf16", "lora.sync=adapters")
    trained = lora_param_counts(adapters.model, adapters.lora).total
    assert 0 < trained < PARAMS
    half = Efficiency(1.0, 1.0, 0.5)
    assert _step(merged, half).phase("weight sync").seconds == approx(PARAMS * 2 / (H100_NVLINK * 0.5))
    assert _step(adapters, half).phase("weight sync").seconds == approx(trained * 2 / (H100_NVLINK * 0.5))


def test_the_pipeline_bubble_by_hand():
    """Qwen3-30B-A3B, PP 2: 512 samples / (4 mini-batches x DP 4) = 32 per rank, 32 x 6,144 tokens
    in micro-batches of 16,384: 12 of them; the bubble is (12 + 2 - 1) / 12."""
    one = load_recipe(RECIPES / "qwen3_30b_a3b.yaml")
    two = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ["parallel.pipeline_model_parallel_size=2"])
    a, b = step_time(one, sync_plan(one, "cuda"), 0.0, ONE), step_time(two, sync_plan(two, "cuda"), 0.0, ONE)
    assert b.phase("π_old").seconds / a.phase("π_old").seconds == approx(13 / 12)
    assert "pipeline bubble x1.08" in b.phase("training").detail


def test_weight_sync_through_the_routes_link():
    """The hand model's fp32 tensors (1,144 x 4 bytes) to the Megatron engine on the same GPU:
    gathered over NVLink; buckets to an engine on another node: through its NIC; vLLM's NCCL
    transfer: bf16 through trainer rank 0's NIC; the CPU: a memory copy."""
    config = _hand()
    counts = count_params(config.model)
    plan = sync_plan(config, "cuda")
    assert plan.route == SyncRoute.DEVICE_IPC
    t = _step(config, Efficiency(1.0, 1.0, 0.5))
    assert t.phase("weight sync").seconds == approx(PARAMS * 4 / (H100_NVLINK * 0.5))
    h100 = MACHINES[GpuType.H100]
    apart = _hand("cluster.nodes=2", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1")
    buckets = sync_plan(apart, "cuda")
    assert buckets.route == SyncRoute.BUCKETS
    cost = sync_cost(apart, counts, buckets, h100)
    assert (cost.nbytes, cost.gbps, cost.bound) == (PARAMS * 4, 50.0, Limit.NETWORK)
    colocated = sync_cost(config, counts, SyncPlan(SyncRoute.BUCKETS, False, "", 1 << 20, "test"), h100)
    assert colocated.gbps == 64.0  # shared memory: the engine GPU's PCIe link
    vllm = load_recipe(RECIPES / "qwen3_30b_a3b.yaml")
    nccl = sync_plan(vllm, "cuda")
    assert nccl.route == SyncRoute.VLLM_NCCL
    q = count_params(vllm.model)
    assert sync_cost(vllm, q, nccl, h100).nbytes == q.total * 2
    wide = sync_cost(
        load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ["parallel.expert_model_parallel_size=16"]),
        q, SyncPlan(SyncRoute.VLLM_IPC, False, "", 1 << 20, "test"), h100,
    )  # fmt: skip
    assert wide.gbps == 50.0  # an expert group of 16 gathers over the NIC, one of 8 over NVLink
    narrow = sync_cost(vllm, q, SyncPlan(SyncRoute.VLLM_IPC, False, "", 1 << 20, "test"), h100)
    assert narrow.gbps == 450.0
    cpu = load_recipe(RECIPES / "tiny_moe.yaml")
    tiny = count_params(cpu.model)
    on_cpu = sync_cost(cpu, tiny, sync_plan(cpu, "cpu"), MACHINES[GpuType.CPU])
    # the tiny recipe's engine takes fp8_block128 bytes on the wire
    assert (on_cpu.nbytes, on_cpu.bound) == (rollout_weight_bytes(cpu, tiny), Limit.MEMORY)


def test_resharded_sync_moves_each_engine_gpu_its_shard():
    config = load_recipe(RECIPES / "deepseek_v3.yaml", ["rollout.tensor_parallel_size=32"])
    counts = count_params(config.model)
    cost = resharded_sync_cost(config, counts, MACHINES[GpuType.H100])
    assert cost.nbytes == counts.total * 2 / 32
    assert cost.gbps == 50.0


def test_the_gather_spans_the_trainer_with_a_pipeline():
    """Megatron's rank order puts the pipeline outermost: with PP > 1 a rank gathers from ranks all
    over the trainer; without, from its contiguous tensor- or expert-parallel group."""
    h100, gb200 = MACHINES[GpuType.H100], MACHINES[GpuType.GB200]
    ep8 = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ["parallel.trainer_world_size=32"])
    assert model_parallel_span(ep8) == 8
    assert gather_gbps(ep8, h100) == 450.0  # one node's NVLink
    pp2 = load_recipe(
        RECIPES / "qwen3_30b_a3b.yaml",
        ["parallel.trainer_world_size=16", "parallel.pipeline_model_parallel_size=2"],
    )
    assert model_parallel_span(pp2) == 16  # 2 stages x EP 8 over 16 GPUs: two H100 nodes
    assert gather_gbps(pp2, h100) == 50.0
    assert gather_gbps(pp2, gb200) == 900.0  # within one 72-GPU NVLink domain
    wide = load_recipe(
        RECIPES / "qwen3_30b_a3b.yaml",
        ["parallel.trainer_world_size=128", "parallel.pipeline_model_parallel_size=4"],
    )
    assert model_parallel_span(wide) == 128  # EP 8 x PP 4 is 32 ranks, but 32 apart
    assert gather_gbps(wide, gb200) == 50.0


def test_nemo_rl_v06_refit_is_a_gather_and_a_broadcast_at_datasheet_rates():
    """DeepSeek-V3 (bf16) colocated on 256 H100 with PP 16 x EP 16: every GPU gathers the whole
    model through its NIC (50 GB/s) and hands it to its engine; on nodes of their own, trainer
    rank 0 broadcasts it through its NIC too, overlapped with the gather: the slower link, 50 GB/s.
    No factor scales either: η_sync 0.5 leaves the time at bytes / 50 GB/s."""
    layout = [
        "cluster.gpu_type=h100", "parallel.trainer_world_size=256", "parallel.tensor_model_parallel_size=1",
        "parallel.expert_model_parallel_size=16", "parallel.pipeline_model_parallel_size=16",
        "rollout.tensor_parallel_size=32", "rollout.num_engines=8",
    ]  # fmt: skip
    colocated = load_recipe(RECIPES / "deepseek_v3.yaml", [*layout, "cluster.nodes=32", "cluster.trainer_nodes=32",
                                                           "cluster.rollout_nodes=0"])  # fmt: skip
    counts = count_params(colocated.model)
    h100 = MACHINES[GpuType.H100]
    cost = gathered_sync_cost(colocated, counts, h100)
    assert (cost.nbytes, cost.gbps, cost.scaled) == (counts.total * 2, 50.0, False)
    assert "CUDA IPC" in cost.words
    assert cost.seconds(0.5) == approx(counts.total * 2 / 50e9)
    assert cost.seconds(0.5) == approx(26.8, abs=0.1)  # 1.34 TB through a 400 Gb/s NIC
    # Qwen3-30B-A3B, EP 8 within a node (no pipeline): the gather runs over NVLink; with the engines
    # on nodes of their own the broadcast from trainer rank 0's NIC is the slower of the two
    q = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ["parallel.trainer_world_size=16"])
    qc = count_params(q.model)
    apart = gathered_sync_cost(q, qc, h100)
    assert (apart.nbytes, apart.gbps) == (qc.total * 2, 50.0)
    assert "broadcast from trainer rank 0's NIC" in apart.words
    together = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", [
        "parallel.trainer_world_size=32", "cluster.nodes=4", "cluster.trainer_nodes=4", "cluster.rollout_nodes=0",
        "rollout.num_engines=16", "rollout.tensor_parallel_size=2",
    ])  # fmt: skip
    assert gathered_sync_cost(together, qc, h100).gbps == 450.0
    # in a step: the sync phase is the bytes at the datasheet rate, whatever η_sync
    t = step_time(together, gathered_sync_cost(together, qc, h100), 0.0, Efficiency(1.0, 1.0, 0.1))
    assert t.phase("weight sync").seconds == approx(qc.total * 2 / 450e9)


def test_the_engines_hold_the_batches_in_flight_they_are_given():
    """Depth 2 on nodes of their own: by default the engine holds 2 batches of 4 samples (8 in
    flight, ceil(4 x 10 / 8) = 5 steps); told that one batch is in flight (NeMo-RL's one step off),
    4 in flight and ceil(4 x 10 / 4) = 10 steps of the hand model."""
    config = _hand(*APART, "run.mode=async", "run.async_depth=2", "run.max_staleness=2")
    default = _step(config)
    assert "5 steps, 8 sequences in flight (continuous batching)" in default.phase("decode").detail
    one = step_time(config, sync_plan(config, "cuda"), 0.0, ONE, batches_in_flight=1)
    per_step = WEIGHT_BYTES - EXPERT_BYTES - EMBEDDING_BYTES + (1 - 0.75**4) * EXPERT_BYTES
    kv = 4 * (5 * 10 + 50) * KV_TOKEN
    assert one.phase("decode").seconds == approx((10 * per_step + kv) / H100_HBM)
    assert "10 steps, 4 sequences in flight (continuous batching)" in one.phase("decode").detail


def test_the_engines_scheduler_bounds_the_sequences_in_flight():
    """vLLM's ``max_num_seqs`` below what the KV cache holds: depth 2 on nodes of their own holds 8
    sequences of the hand model; bounded at 3, ceil(4 x 10 / 3) = 14 steps of 3 (the KV-cache reads
    unchanged); a sync wave of 4 samples bounded at 3 runs in two waves of 3 of 20 steps each."""
    config = _hand(*APART, "run.mode=async", "run.async_depth=2", "run.max_staleness=2")
    bounded = step_time(config, sync_plan(config, "cuda"), 0.0, ONE, max_num_seqs=3)
    per_step = WEIGHT_BYTES - EXPERT_BYTES - EMBEDDING_BYTES + (1 - 0.75**3) * EXPERT_BYTES
    kv = 4 * (5 * 10 + 50) * KV_TOKEN
    assert bounded.phase("decode").seconds == approx((14 * per_step + kv) / H100_HBM)
    assert "14 steps, 3 sequences in flight (continuous batching)" in bounded.phase("decode").detail
    above = step_time(config, sync_plan(config, "cuda"), 0.0, ONE, max_num_seqs=1024)
    assert above.phase("decode").seconds == _step(config).phase("decode").seconds  # the cache binds first
    waves = step_time(_hand(), sync_plan(_hand(), "cuda"), 0.0, ONE, max_num_seqs=3)
    assert "40 steps, 1 sequences in flight (2 wave(s) of 3)" in waves.phase("decode").detail


def test_the_comparison_bounds_nemo_rls_engines_as_vllm_defaults_them():
    """NeMo-RL's async engine is vLLM's ``AsyncLLM`` (at most 128 sequences), its offline one
    ``vllm.LLM`` (1,024 on GPUs of 70 GiB and more), a recipe's ``vllm_kwargs.max_num_seqs`` wins;
    the engines' memory share is the v0.6.0 recipe's (Qwen3-235B one step off: 0.8)."""
    import importlib.util
    import sys

    path = RECIPES.parent / "bench" / "plan_model.py"
    spec = importlib.util.spec_from_file_location("plan_model", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["plan_model"] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    by_recipe = {r.recipe: r for r in bench.STEPS}
    assert bench.engine_max_seqs(by_recipe["grpo-qwen3-30ba3b-4n4g-async-1off"]) == 128
    assert bench.engine_max_seqs(by_recipe["grpo-qwen3-30ba3b-4n8g"]) == 1024
    assert bench.engine_max_seqs(by_recipe["grpo-deepseek-v3-64n8g-fp8-async-1off"]) == 32
    for recipe in ("grpo-qwen3-235b-32n8g-async-1off", "grpo-qwen3-235b-32n4g-async-1off"):
        config = bench.run_config(by_recipe[recipe])
        assert config.rollout.gpu_memory_utilization == 0.8
    # the bound slows the 8 + 8 GB200 one-step-off generation: 256 samples an engine, 128 at a time
    run = by_recipe["grpo-qwen3-30ba3b-4n4g-async-1off"]
    capped = bench.predict_capped(run, FITTED).phase("decode").detail
    assert "128 sequences in flight (continuous batching)" in capped
    assert "128 sequences in flight" not in bench.predict(run, FITTED).phase("decode").detail


def test_offload_moves_the_released_bytes_and_the_engine_weights_out_and_back():
    config = _hand("cluster.release_memory=on")
    t = _step(config, Efficiency(1.0, 1.0, 0.5), released=1e9)
    weights = WEIGHT_BYTES  # the engine's weights on its one GPU, at sleep level 1
    assert t.phase("offload").seconds == approx(2 * (1e9 + weights) / (64e9 * 0.5))
    level2 = _step(_hand("cluster.release_memory=on", "cluster.engine_sleep_level=2"), ONE, released=1e9)
    assert level2.phase("offload").seconds == approx(2 * 1e9 / 64e9)
    assert "offload" not in [p.name for p in _step(config).phases]  # nothing released: no phase


APART = ["cluster.nodes=2", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1"]


@pytest.mark.parametrize(
    ("overrides", "formula"),
    [
        ([], lambda g, o, t, s: g + o + t + s),
        (["run.mode=async"], lambda g, o, t, s: g + o + t + s),  # colocated: the GPUs are shared
        ([*APART, "run.mode=async"], lambda g, o, t, s: o + max(g, t) + s),
        ([*APART, "run.mode=async", "rollout.inflight_updates=true"], lambda g, o, t, s: o + max(g, t + s)),
        ([*APART, "run.mode=async", "run.async_depth=2", "run.max_staleness=2"],
         lambda g, o, t, s: max(g + s, o + t + s)),
        ([*APART, "run.mode=async", "run.async_depth=2", "run.max_staleness=2", "rollout.inflight_updates=true"],
         lambda g, o, t, s: max(g, o + t + s)),
    ],
)  # fmt: skip
def test_how_the_phases_make_the_step(overrides, formula):
    """Sync adds every phase; async on nodes of their own overlaps the generation with the trainer
    (module docstring). The factors make each side the longer in turn."""
    for eff in (Efficiency(1e-6, 1.0, 1.0), Efficiency(1.0, 1e-6, 1.0)):
        t = _step(_hand("algo.kl.coef=0.01", *overrides), eff)
        g = t.phase("prefill").seconds + t.phase("decode").seconds
        o = t.phase("π_old").seconds + t.phase("reference").seconds
        assert t.seconds == approx(formula(g, o, t.phase("training").seconds, t.phase("weight sync").seconds))


def test_the_shorter_side_of_an_async_step_is_marked_beside_it():
    slow_engines = _step(_hand(*APART, "run.mode=async"), Efficiency(1e-6, 1.0, 1.0))
    assert {p.name for p in slow_engines.phases if p.overlapped} == {"training"}
    slow_trainer = _step(_hand(*APART, "run.mode=async"), Efficiency(1.0, 1e-6, 1.0))
    assert {p.name for p in slow_trainer.phases if p.overlapped} == {"prefill", "decode"}
    assert not any(p.overlapped for p in _step(_hand()).phases)


@pytest.mark.parametrize(
    ("gpus", "memory", "named", "expected"),
    [(0, 80, GpuType.AUTO, GpuType.CPU), (8, 80, GpuType.AUTO, GpuType.H100), (8, 140, GpuType.AUTO, GpuType.H200),
     (8, 141, GpuType.AUTO, GpuType.H200), (8, 180, GpuType.AUTO, GpuType.B200), (4, 186, GpuType.AUTO, GpuType.GB200),
     (8, 96, GpuType.B200, GpuType.B200)],
)  # fmt: skip
def test_the_chip_a_recipe_names(gpus, memory, named, expected):
    config = load_recipe(
        RECIPES / "tiny_moe.yaml",
        [f"cluster.gpus_per_node={gpus}", f"cluster.gpu_memory_gib={memory}", f"cluster.gpu_type={named}"],
    )
    assert machine_of(config) is MACHINES[expected]


def test_an_unknown_chip_is_refused_naming_the_known_ones():
    with pytest.raises(
        ConfigError, match=r"^cluster.gpu_type='a100' is not one of: auto, h100, h200, b200, gb200, cpu$"
    ):
        load_recipe(RECIPES / "tiny_moe.yaml", ["cluster.gpu_type=a100"])
    config = load_recipe(RECIPES / "deepseek_v3.yaml", ["cluster.gpu_memory_gib=96"])
    with pytest.raises(ConfigError) as info:
        machine_of(config)
    assert str(info.value) == (
        "cluster.gpu_type=auto: no known GPU has cluster.gpu_memory_gib=96; set cluster.gpu_type to one of "
        "h100, h200, b200, gb200, cpu"
    )


@pytest.mark.parametrize(
    "override", ["cluster.train_mfu=0", "cluster.train_mfu=1.5", "cluster.mean_length_fraction=0"]
)
def test_a_factor_out_of_range_is_refused(override):
    """When the recipe loads, as every value of the recipe is checked on its own."""
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}={value:s}(\.0)? must be in \(0, 1\]$"):
        load_recipe(RECIPES / "tiny_moe.yaml", [override])


def test_a_kv_cache_that_holds_no_sequence_stops_the_step_time():
    config = load_recipe(RECIPES / "kimi_k2.yaml", ["rollout.gpu_memory_utilization=0.43"])
    with pytest.raises(PhaseCannotRun, match=r"^generation cannot run: the KV cache holds [\d,]+ tokens per engine, "
                       r"less than the longest sequence \(18,432\)"):  # fmt: skip
        step_time(config, sync_plan(config, "cuda"))
    with pytest.raises(PhaseCannotRun, match="sync route is refused"):
        step_time(load_recipe(RECIPES / "kimi_k2.yaml"), None)


def test_the_recipes_mfu_replaces_the_fitted_one_and_defaults_to_it():
    assert ClusterConfig().train_mfu == FITTED.train_mfu
    ep1 = ["parallel.expert_model_parallel_size=1"]  # no all-to-all: the passes are all compute
    config = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ep1)
    half = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", [*ep1, f"cluster.train_mfu={FITTED.train_mfu / 2}"])
    a, b = step_time(config, sync_plan(config, "cuda")), step_time(half, sync_plan(half, "cuda"))
    assert b.phase("training").seconds == approx(2 * a.phase("training").seconds)
    assert b.phase("decode").seconds == a.phase("decode").seconds


# NCCL's latency model for the LL protocol (src/graph/tuning.cc): base 3.6 µs (ring) / 4.4 (tree);
# a hop 0.47 / 0.52 µs over NVLink (x1.8 across nodes), 2.7 / 5.0 over the network.
@pytest.mark.parametrize(
    ("ranks", "domain", "expected"),
    [
        (1, 8, 0.0),
        (2, 8, 3.6 + 2 * 0.47),  # ring: 2 NVLink steps (tree: 4.4 + 2 * 0.52)
        (8, 8, 3.6 + 14 * 0.47),  # ring: 14 NVLink steps (tree: 4.4 + 2 * 7 * 0.52 = 11.68)
        (32, 8, 4.4 + 2 * (7 * 0.52 * 1.8 + 2 * 5.0)),  # tree over 4 nodes (ring: 67.2)
        (32, 72, 3.6 + 62 * 0.47),  # one NVLink domain: ring (tree: 4.4 + 62 * 0.52 = 36.64)
        (16, 8, 4.4 + 2 * (7 * 0.52 * 1.8 + 1 * 5.0)),  # tree over 2 nodes (ring: 3.6 + 28*.846 + 2*2.7)
        (4, 2, 3.6 + 4 * 0.47 * 1.8 + 2 * 2.7),  # ring over 2 nodes of 2 (tree: 4.4 + 2 * (0.936 + 5.0))
        (12, 8, 3.6 + 20 * 0.47 * 1.8 + 2 * 2.7),  # 8 + 4 over 2 nodes: ring (tree: 27.504)
    ],
)
def test_allreduce_latency_as_nccl_models_it(ranks, domain, expected):
    assert allreduce_latency_us(ranks, domain) == approx(expected)


def test_allreduce_and_alltoall_seconds_by_hand():
    h100, gb200 = MACHINES[GpuType.H100], MACHINES[GpuType.GB200]
    # 1 MB over 32 H100 (4 nodes): the tree's latency + 2 * 31/32 of it through the 50 GB/s NIC
    assert allreduce_seconds(1e6, 32, h100) == approx(37.504e-6 + 2 * 31 / 32 * 1e6 / 50e9)
    # over 2 GPUs of a node: the ring's latency + 2 * 1/2 of it over NVLink (450 GB/s)
    assert allreduce_seconds(1e6, 2, h100) == approx(4.54e-6 + 1e6 / 450e9)
    # 32 GB200 share one NVLink domain (900 GB/s)
    assert allreduce_seconds(1e6, 32, gb200) == approx(32.74e-6 + 2 * 31 / 32 * 1e6 / 900e9)
    assert allreduce_seconds(1e6, 1, h100) == 0.0
    # an all-to-all of 1 GB per GPU: within a node over NVLink; EP 16 over 2 nodes: half through the NIC
    assert alltoall_seconds(1e9, 8, h100) == approx(1e9 / 450e9)
    assert alltoall_seconds(1e9, 16, h100) == approx(0.5e9 / 50e9)
    assert alltoall_seconds(1e9, 64, h100) == approx(56 / 64 * 1e9 / 50e9)
    assert alltoall_seconds(1e9, 64, gb200) == approx(1e9 / 900e9)
    assert alltoall_seconds(1e9, 1, h100) == 0.0


def test_tensor_parallel_all_reduces_by_hand():
    """The hand model on engines of TP 2: each GPU reads half the weights (800 bytes a step) and the
    whole KV cache (its one KV head replicated); every decode step adds 2 layers x 2 all-reduces of
    the 2 sequences in flight (2 x 8 x 2 bytes) over NVLink, the prefill 4 of its 4 x 5 tokens."""
    t = _step(_hand("rollout.tensor_parallel_size=2"))
    reduce_step = 3.6e-6 + 2 * 0.47e-6 + (2 * 8 * 2) / 450e9
    memory = (20 * 800 + 4 * (5 * 10 + 50) * KV_TOKEN) / H100_HBM
    assert t.phase("decode").seconds == approx(memory + 20 * 4 * reduce_step)
    assert "4 TP-2 all-reduces a step over NVLink (18 µs)" in t.phase("decode").detail
    prefill = 4 * (5 * PER_TOKEN + 15 * PER_PAIR) / 2 / H100_BF16
    assert t.phase("prefill").seconds == approx(prefill + 4 * (4.54e-6 + (4 * 5 * 8 * 2) / 450e9))
    # TP 1: no all-reduce
    assert "all-reduce" not in _step(_hand()).phase("decode").detail


def test_activation_recompute_and_expert_all_to_all_by_hand():
    """Recompute: training is 4 forwards, not 3. EP 4 on one node of 8: each of the 8 sequences'
    15 tokens goes to its top-1 expert and back (its hidden state of 8 in bf16) in each of 2 MoE
    layers: 2 x 8 x 15 x 2 x 1 x 8 x 2 = 7,680 bytes, 960 per GPU over NVLink, once a forward,
    twice a backward and three times with the recompute."""
    forward = 8 * 15 * PER_TOKEN + 8 * (15 * 16 // 2) * PER_PAIR
    rate = 8 * H100_BF16
    a2a = 960 / 450e9
    t = _step(_hand("parallel.expert_model_parallel_size=4", "trainer.recompute_activations=true",
                    "trainer.precision=bf16"))  # fmt: skip
    assert t.phase("π_old").seconds == approx(forward / rate + a2a)
    assert t.phase("training").seconds == approx(4 * forward / rate + 3 * a2a)
    assert "with the activation recompute" in t.phase("training").detail
    plain = _step(_hand("parallel.expert_model_parallel_size=4", "trainer.precision=bf16"))
    assert plain.phase("training").seconds == approx(3 * forward / rate + 2 * a2a)
    none = _step(_hand("trainer.precision=bf16"))  # EP 1: no all-to-all
    assert none.phase("training").seconds == approx(3 * forward / rate)


def test_an_all_reduce_over_a_whole_nvlink_domain_stays_on_nvlink():
    """8 GPUs, the whole of an H100 node: the ring's latency + 2 * 7/8 of the bytes over NVLink."""
    h100 = MACHINES[GpuType.H100]
    assert allreduce_seconds(1e6, 8, h100) == approx((3.6 + 14 * 0.47) * 1e-6 + 2 * 7 / 8 * 1e6 / 450e9)


# In FLOPs and bytes (the seconds times the rate) below, the numbers the docstrings count.
PREFILL_FLOPS = 4 * (5 * PER_TOKEN + 15 * PER_PAIR)  # 4 samples x (5 tokens + 5*6/2 causal pairs)
DECODE_BYTES = 20 * 1600 + 4 * (5 * 10 + 10**2 / 2) * KV_TOKEN  # test_generation_by_hand's


@pytest.mark.parametrize(
    ("quant", "peak"),
    [("bf16", 989e12), ("fp8_block128", 989e12), ("fp8_tensor", 1979e12)],
)
def test_the_prefill_runs_at_the_peak_of_the_rollouts_activations(quant, peak):
    """The hand model's prefill, 4 x (5 x 1,344 + 15 x 64) = 30,720 FLOPs, at the bf16 peak when the
    activations stay bf16 (bf16, fp8 weights only) and at the fp8 peak with fp8 activations (W8A8)."""
    assert PREFILL_FLOPS == 30_720
    t = _step(_hand(f"rollout.quant={quant}"))
    assert t.phase("prefill").seconds * peak == approx(PREFILL_FLOPS)


def test_an_engine_takes_its_share_of_the_prompts_rounded_up():
    """4 prompts of 2 over 3 engines: an engine takes 2 prompts, 4 samples, the hand model's
    generation of test_generation_by_hand."""
    t = _step(_hand("rollout.num_engines=3"))
    assert t.phase("prefill").seconds * H100_BF16 == approx(PREFILL_FLOPS)
    assert t.phase("decode").seconds * H100_HBM == approx(DECODE_BYTES)
    assert "20 steps, 2 sequences in flight (1 wave(s) of 4)" in t.phase("decode").detail


def test_a_tied_embedding_is_read_at_every_decode_step():
    """Tied, the hand model has no separate head (1,016 parameters, 2,032 bytes): the embedding is
    the output layer, read every step: 2,032 - 768 of experts + 7/16 of them = 1,600 bytes a step."""
    config = _hand("model.tie_word_embeddings=true")
    assert rollout_weight_bytes(config, count_params(config.model)) == 2032
    t = _step(config)
    assert t.phase("decode").seconds * H100_HBM == approx(20 * (2032 - 768 + (1 - 0.75**2) * 768) + 12_800)


def test_the_generation_factor_scales_the_prefill_and_a_compute_bound_decode():
    """The tiny recipe on the CPU machine (test_decode_is_compute_bound_on_the_cpu) at η_gen 0.5: the
    prefill's 64 x (9.6 x 151,552 + 9.6 x 10.6 / 2 x 512) FLOPs and the decode's at half the rate."""
    config = load_recipe(RECIPES / "tiny_moe.yaml")
    t = step_time(config, sync_plan(config, "cpu"), 0.0, Efficiency(0.5, 1.0, 1.0))
    p, r = 0.6 * 16, 0.6 * 8
    rate = MACHINES[GpuType.CPU].fp32_tflops * 1e12 * 0.5
    assert t.phase("prefill").seconds * rate == approx(64 * (p * 151_552 + p * (p + 1) / 2 * 512))
    decode = t.phase("decode")
    assert decode.bound == Limit.COMPUTE
    assert decode.seconds * rate == approx(64 * (r * 151_552 + (p * r + r**2 / 2) * 512))


def test_continuous_batching_on_the_cpu_holds_the_batches_in_flight():
    """The tiny recipe's engine on a process of its own at depth 2 (no KV cache bounds it on the
    CPU): 2 batches of 64 samples in flight, ceil(64 x 4.8 / 128) = 3 steps."""
    config = load_recipe(RECIPES / "tiny_moe.yaml", [
        "run.mode=async", "run.async_depth=2", "run.max_staleness=2", "cluster.nodes=2",
        "cluster.trainer_nodes=1", "cluster.rollout_nodes=1",
    ])  # fmt: skip
    t = step_time(config, sync_plan(config, "cpu"), 0.0, ONE)
    assert "3 steps, 128 sequences in flight (continuous batching)" in t.phase("decode").detail


def test_context_parallelism_takes_its_ranks_from_data_parallelism():
    """PP 2 x CP 2 of 8 GPUs: DP 2, 4 sequences of 15 tokens a rank, micro-batches of 32 tokens: 2 of
    them, the bubble (2 + 2 - 1) / 2 = 1.5 on the hand model's 222,720 forward FLOPs (DP 4 would
    be one micro-batch and a bubble of 2)."""
    t = _step(_hand(
        "parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
        "trainer.max_tokens_per_microbatch=32", "trainer.precision=bf16", "algo.routing_replay=off",
    ))  # fmt: skip
    forward = 8 * 15 * PER_TOKEN + 8 * (15 * 16 // 2) * PER_PAIR
    assert t.phase("π_old").seconds * 8 * H100_BF16 == approx(forward * 1.5)
    assert "pipeline bubble x1.50" in t.phase("π_old").detail


def test_expert_tensor_parallelism_widens_the_all_to_all_group():
    """EP 4 x ETP 4 over 16 GPUs of 2 nodes (experts of width 4, 16 samples): an all-to-all group of
    16, half of it through the NIC. 16 sequences' 15 tokens to their top-1 expert and back in 2 MoE
    layers, hidden 8 in bf16: 15,360 bytes, 960 per GPU, 480 of them to the other node at 50 GB/s.
    Per token the hand model's 1,344 FLOPs with an expert of 2 x 2 x 96 instead of 2 x 2 x 48."""
    t = _step(_hand(
        "cluster.nodes=2", "cluster.trainer_nodes=2", "parallel.trainer_world_size=16", "rollout.batch_size=16",
        "parallel.expert_model_parallel_size=4", "parallel.expert_tensor_parallel_size=4", "trainer.precision=bf16",
        "model.moe_ffn_hidden_size=4",
    ))  # fmt: skip
    forward = 16 * 15 * (PER_TOKEN + 2 * 2 * 48) + 16 * (15 * 16 // 2) * PER_PAIR
    assert forward == 491_520
    assert t.phase("π_old").seconds == approx(forward / (16 * H100_BF16) + 480 / 50e9)
    assert t.phase("π_old").detail.endswith(" s of EP-4 x ETP-4 all-to-all")


def test_lora_with_the_router_trained_keeps_the_routers_gradients():
    """``lora.train_router``: the routers' 2 x 2 x 8 x 4 = 128 FLOPs a token keep their weights'
    gradients; the other 1,216 of the 1,344 skip theirs (test_lora_skips_the_frozen_weights_gradients_by_hand)."""
    tokens = 8 * 15
    forward = tokens * PER_TOKEN + 8 * (15 * 16 // 2) * PER_PAIR
    t = _step(_hand("lora.rank=4", "lora.train_router=true", "trainer.precision=bf16"))
    assert t.phase("training").seconds * 8 * H100_BF16 == approx(3 * forward - tokens * (PER_TOKEN - 128))


def test_a_vllm_engine_takes_bf16_buckets_from_an_fp32_trainer():
    """vLLM loads the model in bf16: buckets to it carry the hand model's 1,144 parameters in 2 bytes,
    though the trainer holds them in fp32, through the engine's NIC."""
    config = _hand(
        "rollout.engine=vllm", "rollout.max_model_len=128", "trainer.precision=fp32", *APART,
        "rollout.sync_transport=buckets",
    )  # fmt: skip
    assert sync_plan(config, "cuda").route == SyncRoute.BUCKETS
    t = _step(config, Efficiency(1.0, 1.0, 0.5))
    assert t.phase("weight sync").seconds * 50e9 * 0.5 == approx(PARAMS * 2)


@pytest.mark.parametrize(
    ("overrides", "engines_hidden"),
    [
        (["rollout.inflight_updates=true"], {"training", "weight sync"}),  # depth 1: max(gen, train + sync)
        (["run.async_depth=2", "run.max_staleness=2"], {"π_old", "training", "weight sync"}),
    ],
)
def test_the_shorter_side_of_a_deeper_or_inflight_async_step_is_marked_beside_it(overrides, engines_hidden):
    """Slow engines: the trainer's side of the max is beside the step (at depth 2 all of π_old,
    training and the sync); a slow trainer: the generation."""
    config = _hand(*APART, "run.mode=async", *overrides)
    slow_engines = _step(config, Efficiency(1e-6, 1.0, 1.0))
    assert {p.name for p in slow_engines.phases if p.overlapped} == engines_hidden
    slow_trainer = _step(config, Efficiency(1.0, 1e-6, 1.0))
    assert {p.name for p in slow_trainer.phases if p.overlapped} == {"prefill", "decode"}
