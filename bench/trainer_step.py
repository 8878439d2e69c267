"""Trainer step time of a small MoE: what R3 replay and the stability stack cost.

Four workers built from the tiny recipe (same seed, same weights, same batch), timed
interleaved in one process so machine drift hits all of them alike. One step =
``compute_old_logp`` + ``train_step`` over the rollout batch (the batches on the device first).

* ``base``:   no replay, PPO-clip, no corrections, no keep-sampling-mask, no diagnostics.
* ``r3``:     ``base`` + R3 routing replay in both passes (Megatron RouterReplay).
* ``stack``:  ``r3`` + keep-sampling-mask + IcePop + OPSM + ESPO (full-vocabulary entropy of
  π_old) + diagnostics (mismatch metrics, routing agreement).
* ``seq``:    ``base`` with Megatron's ``SequentialMLP`` experts (``trainer.expert_gemm=sequential``),
  against which the grouped experts every other worker runs (the default, ``auto``: torch's
  grouped matrix product without transformer-engine) are measured.
* ``stack+``: ``stack`` as on a later mini-batch of the same rollout batch: the weights moved
  since the old-logp pass, so the update pass recomputes the routing agreement (on the first
  mini-batch it reuses the old-logp pass's, which is exact: same weights, same ids).

Sizes (``--size``):

* ``tiny``: the tiny recipe's model as shipped (2 layers, hidden 64, 8 experts top-2, vocab 16,
  fp32), the recipe's 64 responses of up to 16 + 8 tokens.
* ``mid``:  4 layers, hidden 1024, 64 experts top-8 (expert width 512), 16 heads with 4 KV heads
  (GQA, head_dim 64), vocab 32,768, bf16; 64 responses of up to 128 prompt + 384 response tokens
  (about 16k tokens per step), micro-batches of at most 8,192 tokens.
* ``large``: 8 layers, hidden 4096, 16 experts top-4 (width 1024), 32 heads with 8 KV heads of
  128, vocab 32,768, bf16, the same responses; about 2.4 B parameters, so run it with two
  workers (``--variants seq,base``).

Throughput: each worker's model FLOPs per step (`moe_rl.planner.flops`: the π_old forward and the
training forward and backward) over its median step time, as TFLOP/s and as MFU against a square
matrix product measured on the same device at the start of the run.

Devices (``--device``, default cuda when available):

* ``cpu``: CPU time of this process with one torch thread (``--threads``) is what is compared,
  because a shared 2-core box makes wall-clock ratios swing by ±10 %. CUDA is hidden from the
  process (the workers compute on the CPU).
* ``cuda``: wall time per step between two ``torch.cuda.Event`` records, synchronized after
  each step (the GPU is not shared, so wall time is the cost).

Printed: per-step times, TFLOP/s and MFU, the paired ratios ``r3/base − 1`` (target ≤ +3 %) and
``1 − r3/stack``, the share of the step spent in corrections + KSM + ESPO + diagnostics (target
≤ 5 %), plus the stack worker's own phase timers, and the ``perf/tflops`` and ``perf/mfu`` a training
run logs for the base worker (three steps through `TrainerWorker.old_logp` and `TrainerWorker.train`,
their own clock and FLOP count) against the bench's figure (target: within 1.5×). Not a test:
numbers depend on the machine.

    python bench/trainer_step.py [--quick]                       # tiny MoE on the CPU
    python bench/trainer_step.py --device cuda --size mid        # mid-size MoE on one GPU
    python bench/trainer_step.py --device cuda --size large --variants seq,base
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for moe_rl

log = logging.getLogger("bench.trainer_step")

BASE = [
    "algo.routing_replay='off'",
    "algo.objective=ppo_clip",
    "algo.aggregation=token_mean",
    "algo.corrections.keep_sampling_mask=false",
    "algo.corrections.icepop.enabled=false",
    "algo.corrections.opsm.enabled=false",
    "trainer.compute_entropy=false",
]
R3 = [*BASE, "algo.routing_replay=r3"]
STACK: list[str] = []  # the tiny recipe as shipped: R3, KSM, IcePop, OPSM, ESPO

SIZES = {
    "tiny": [],
    "mid": [
        "model.vocab_size=32768",
        "model.hidden_size=1024",
        "model.num_layers=4",
        "model.num_attention_heads=16",
        "model.num_key_value_heads=4",
        "model.head_dim=64",
        "model.ffn_hidden_size=2816",  # dense layers only (there are none: all 4 are MoE)
        "model.moe_ffn_hidden_size=512",
        "model.num_experts=64",
        "model.moe_router_topk=8",
        "model.max_position_embeddings=1024",
        "data.max_prompt_len=128",
        "rollout.max_new_tokens=384",
        "rollout.max_model_len=1024",
        "rollout.batch_size=64",
        "trainer.precision=bf16",
        "trainer.max_tokens_per_microbatch=8192",
    ],
}
SIZES["large"] = [
    *SIZES["mid"],
    "model.hidden_size=4096",
    "model.num_layers=8",
    "model.num_attention_heads=32",
    "model.num_key_value_heads=8",
    "model.head_dim=128",
    "model.moe_ffn_hidden_size=1024",
    "model.num_experts=16",
    "model.moe_router_topk=4",
]
VARIANTS = {
    "seq": [*BASE, "trainer.expert_gemm=sequential"],
    "base": BASE,
    "r3": R3,
    "stack": STACK,
    "stack+": STACK,
}


def make_batches(config, num_samples: int, seed: int):
    """The rollout batch of `rollout_batch`, packed into the worker's micro-batches."""
    from moe_rl.trainer.batch import make_train_micro_batches

    batch, advantages = rollout_batch(config, num_samples, seed)
    return make_train_micro_batches(batch, advantages, config.trainer.max_tokens_per_microbatch)


def rollout_batch(config, num_samples: int, seed: int):
    """(random trajectories of the recipe's lengths, one advantage per sample)."""
    import torch

    from moe_rl.data.synthetic import random_batch

    model = config.model
    num_moe = model.num_layers - model.first_k_dense_layers
    batch = random_batch(
        seed,
        num_samples,
        max_prompt_len=config.data.max_prompt_len,
        max_response_len=config.rollout.max_new_tokens,
        vocab_size=model.vocab_size,
        routing=(num_moe, model.moe_router_topk, model.num_experts),
        sampling_mask=True,
    )
    advantages = torch.randn(num_samples, generator=torch.Generator().manual_seed(seed))
    return batch, advantages


def on_policy(worker, batches) -> list:
    """The batches on the worker's device (moved once, before any timing), each with its rollout
    log-probs set to the worker's own (rollout = trainer, no mismatch)."""
    batches = [mb.to(worker.device) for mb in batches]
    prepared, _ = worker.compute_old_logp(batches)
    for mb, old in zip(batches, prepared):
        mb.micro.rollout_logp = old.old_logp.detach().clone()
    return batches


def one_step(worker, batches, cuda: bool, later_mini_batch: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step. On CUDA the wall time is measured
    between two events and the step is synchronized before returning."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    wall, cpu = time.perf_counter(), time.process_time()
    prepared, _ = worker.compute_old_logp(batches)
    if later_mini_batch:
        prepared = [dataclasses.replace(mb, old_weights_version=-1) for mb in prepared]
    worker.train_step(prepared)
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, time.process_time() - cpu
    return time.perf_counter() - wall, time.process_time() - cpu


def loop_mfu(worker, config, samples: int, steps: int = 3) -> tuple[float, float]:
    """(median ``perf/tflops``, median ``perf/mfu``) of ``steps`` steps of the same rollout batch as
    a training run takes them: `TrainerWorker.old_logp` then `TrainerWorker.train`, whose own
    clock and FLOP count give the metrics the run logs."""
    from moe_rl.trainer.batch import TrainerBatch

    batch, advantages = rollout_batch(config, samples, seed=0)
    whole = TrainerBatch.whole(
        batch, advantages, config.trainer.max_tokens_per_microbatch, num_mini_batches=1
    )
    records = [worker.train(worker.old_logp(whole)) for _ in range(steps)]
    return (
        statistics.median(r["perf/tflops"] for r in records),
        statistics.median(r["perf/mfu"] for r in records),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repetitions")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu"
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="model size (default: mid on cuda, tiny on cpu)"
    )
    parser.add_argument("--samples", type=int, default=None, help="responses per step (default: recipe)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per worker")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"workers to time, from {','.join(VARIANTS)} (base needed)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="after timing, profile 3 steps of each worker with torch.profiler "
        "(a Chrome trace per worker in DIR, the top operators by host time printed)"
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1, help="cpu only: torch intra-op threads (1: steadier on a busy box)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        # A worker computes on CUDA whenever its process sees it: hide it before torch starts CUDA.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False on this machine")
    cuda = device == "cuda"
    size = args.size or ("mid" if cuda else "tiny")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not cuda:
        torch.set_num_threads(args.threads)

    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.trainer.perf import matmul_tflops
    from moe_rl.trainer.worker import TrainerWorker

    recipe = ROOT / "recipes" / "tiny_moe.yaml"
    common = [*SIZES[size], f"run.device={device}"]
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "base" not in names:
        raise SystemExit(f"--variants {args.variants}: choose from {', '.join(VARIANTS)}, base included")
    configs = {name: load_checked(recipe, [*common, *VARIANTS[name]]) for name in VARIANTS if name in names}
    peak = matmul_tflops(torch.device(device), _dtype(configs["base"]))
    samples = args.samples or (16 if args.quick else configs["base"].rollout.batch_size)
    reps = args.reps or (5 if args.quick else 40)
    workers = {
        name: TrainerWorker(cfg, total_steps=10_000, diagnostics=name.startswith("stack"))
        for name, cfg in configs.items()
    }
    batches = {name: make_batches(cfg, samples, seed=0) for name, cfg in configs.items()}
    for name, worker in workers.items():
        batches[name] = on_policy(worker, batches[name])
        for _ in range(2 if cuda else 1):  # warm-up (CUDA: allocator, cuBLAS handles, autotuning)
            one_step(worker, batches[name], cuda)
        worker.timer.seconds.clear()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in workers}
    order = list(workers)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:  # rotate who goes first
            times[name].append(
                one_step(workers[name], batches[name], cuda, later_mini_batch=name == "stack+")
            )
    bench_rate = report(times, workers, samples, batches, size, configs["base"], cuda, peak)
    loop_rate, loop_mfu_ = loop_mfu(workers["base"], configs["base"], samples)
    print(
        f"training loop's perf/tflops (base, TrainerWorker.old_logp + train): {loop_rate:.3f} TFLOP/s, "
        f"perf/mfu {loop_mfu_:.2%}; bench/loop = {bench_rate / max(loop_rate, 1e-30):.2f}x (target within 1.5x)"
    )
    if args.profile:
        for name in ("seq", "base"):
            if name in workers:
                profile(workers[name], batches[name], cuda, Path(args.profile) / f"{size}_{name}.json")


def profile(worker, batches, cuda: bool, trace: Path, steps: int = 3) -> None:
    """Where a step's host time goes: ``steps`` steps under torch.profiler, the operators with the
    most host (self CPU) time, and the kernels launched per step (a launch-bound step launches many
    small ones)."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            one_step(worker, batches, cuda)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    print(f"profile of {trace.stem} ({steps} steps; trace {trace}):")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    if cuda:
        launches = sum(
            e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        )
        print(f"kernel launches per step: {launches / steps:.0f}")


def _dtype(config):
    import torch

    return torch.bfloat16 if config.trainer.precision == "bf16" else torch.float32


def paired(times: dict[str, list[tuple[float, float]]], name: str, ref: str, index: int) -> float:
    """Median over repetitions of the time ratio ``name / ref`` within the same repetition
    (neighbouring measurements share the machine's load, so the ratio cancels most of it).
    ``index``: 0 compares wall time (CUDA), 1 CPU time of this process (CPU)."""
    return statistics.median(a[index] / b[index] for a, b in zip(times[name], times[ref], strict=True))


def report(times, workers, samples: int, all_batches, size: str, config, cuda: bool, peak: float) -> float:
    """Prints the figures; returns the base worker's TFLOP/s."""
    import torch

    from moe_rl.planner.flops import model_flops
    from moe_rl.trainer.perf import sequence_lengths

    batches = all_batches["base"]
    tokens = sum(mb.micro.num_tokens for mb in batches)
    lengths = sequence_lengths(mb.micro.cu_seqlens for mb in batches)
    flops = model_flops(config.model)
    step_flops = flops.forward(lengths) + flops.forward_backward(lengths)  # π_old, then the update
    m = config.model
    what = (
        f"{size} MoE ({m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts top-"
        f"{m.moe_router_topk}, vocab {m.vocab_size}, {config.trainer.precision})"
    )
    if cuda:
        where = f"on {torch.cuda.get_device_name()}, wall time per step (CUDA events)"
    else:
        where = f"on cpu, CPU time of this process, torch threads {torch.get_num_threads()}"
    print(f"{what}, {samples} responses ({tokens} tokens, {len(batches)} micro-batches) per step, "
          f"{len(times['base'])} timed steps each, {where}")  # fmt: skip
    print(f"model FLOPs per step {step_flops:.3e} ({flops.forward(lengths) / tokens:.3e} "
          f"per token and forward); matrix product on this device: {peak:.2f} TFLOP/s")  # fmt: skip
    index = 0 if cuda else 1
    for name in times:
        median = statistics.median(t[0] for t in times[name])  # wall
        rate = step_flops / median / 1e12
        print(
            f"  {name:6s} {rate:8.3f} TFLOP/s   MFU {rate / peak:6.2%}   (wall median {median * 1e3:.1f} ms)"
        )
    for name in times:
        if cuda:
            wall = [w for w, _ in times[name]]
            print(f"  {name:6s} wall min {min(wall) * 1e3:7.1f} ms   wall median {statistics.median(wall) * 1e3:7.1f} ms"
                  f"   host CPU median {statistics.median(c for _, c in times[name]) * 1e3:7.1f} ms")  # fmt: skip
        else:
            cpu = [c for _, c in times[name]]
            print(f"  {name:6s} CPU min {min(cpu) * 1e3:7.1f} ms   CPU median {statistics.median(cpu) * 1e3:7.1f} ms"
                  f"   wall min {min(w for w, _ in times[name]) * 1e3:7.1f} ms")  # fmt: skip
    if "seq" in times:
        print(f"grouped experts       seq/base           = {paired(times, 'seq', 'base', index):.2f}x")
    if "r3" in times:
        print(
            f"R3 replay overhead    r3/base - 1        = {paired(times, 'r3', 'base', index) - 1:+.2%}  "
            "(target <= +3%)"
        )
    for name in ("stack", "stack+"):
        if name in times and "r3" in times:
            share = 1 - 1 / paired(times, name, "r3", index)
            print(f"{name:6s} share          1 - r3/{name:6s}    = {share:+.2%}  (target <= 5%)")
    if cuda:
        print(f"peak GPU memory allocated (all workers): {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    timed = "stack" if "stack" in times else "base"
    phases = dict(workers[timed].timer.seconds)  # seconds per phase since the worker started
    total = sum(w for w, _ in times[timed])
    note = " (host timers: on cuda they see kernel launches, not the kernels)" if cuda else ""
    print(f"{timed} worker phase timers (wall, share of its timed steps){note}:")
    for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {phase:12s} {seconds / total:6.1%}")
    return step_flops / statistics.median(t[0] for t in times["base"]) / 1e12


if __name__ == "__main__":
    main()
