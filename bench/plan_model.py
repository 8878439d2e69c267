"""The step-time model of `moe-rl plan` (`moe_rl.planner.step_time`) against published runs, and the
one command that regenerates docs/plan_model.md.

Each published run is described with its own settings (model, GPUs, the trainer's and the engines'
layout, batch, lengths, colocated or not, on-policy or off) as overrides of the shipped recipe of the
same model; the model predicts its step (or its refit) and the tables give the ratio. The efficiency
factors (`moe_rl.planner.step_time.FITTED`) are fitted on one configuration, NeMo-RL's Qwen3-30B-A3B
on four nodes of 8 H100: its on-policy step, its one-step-off step and its refit fix the generation,
training and sync factors (three figures, three factors); every other row is a prediction, and the
same fit on DeepSeek-V3's configuration shows how much the choice matters. The project's own tiny
recipe on the CPU is compared phase by phase with the `time/*` metrics of
`moe-rl train recipes/tiny_moe.yaml`.

    python bench/plan_model.py                      # the comparison tables
    python bench/plan_model.py --fit                # the factors fitted on each calibration
    python bench/plan_model.py --measure            # this CPU's matmul rate and memory bandwidth
    python bench/plan_model.py --write docs/plan_model.md [--tiny-run RUN_DIR]

``--write`` trains the tiny recipe for its metrics (about a minute on two cores) unless
``--tiny-run`` names a finished run of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_rl.config import RecipeConfig, load_recipe  # noqa: E402
from moe_rl.config.modes import GpuType  # noqa: E402
from moe_rl.planner.estimate import estimate  # noqa: E402
from moe_rl.planner.flops import count_params  # noqa: E402
from moe_rl.planner.step_time import (  # noqa: E402
    FITTED,
    MACHINES,
    Chip,
    Efficiency,
    StepTime,
    SyncCost,
    gathered_sync_cost,
    machine_of,
    resharded_sync_cost,
    step_time,
    transfer_seconds,
)

RECIPES = REPO / "recipes"
NEMO_RL = "NeMo-RL v0.6 docs/about/performance-summary.md"
NEMO_REFIT = "NeMo-RL docs/design-docs/nccl-reshard-refit.md"
PROMPT_BUDGET = 256
"""Tokens of a published run's longest prompt (OpenMathInstruct-2's math problems are short); the
rest of its total length is the response budget."""


@dataclass(frozen=True)
class NemoRun:
    """One GRPO row of NeMo-RL's performance summary, with the settings of its recipe
    (examples/configs/recipes/llm/performance/*.yaml at the same release)."""

    label: str
    model: str
    gpu: str
    gpus: int
    gen_gpus: int
    """GPUs of the engines on nodes of their own; 0: colocated on all ``gpus``."""
    gen_tp: int
    train: tuple[int, int, int, int]
    """TP, CP, EP, PP."""
    prompts: int
    generations: int
    max_len: int
    avg_len: int
    """The published mean sequence length of a step (prompt and response)."""
    seconds: float
    off_policy: int = 0
    """Steps off policy (0: on-policy)."""
    gen_util: float = 0.6
    fp8: bool = False
    train_batch: int = 512
    recipe: str = ""
    async_engine: bool = True
    """vLLM's ``AsyncLLM`` (the recipe's ``vllm_cfg.async_engine``), else the offline ``vllm.LLM``."""
    max_num_seqs: int | None = None
    """The recipe's ``vllm_kwargs.max_num_seqs`` (None: vLLM's default for the engine class)."""

    @property
    def samples(self) -> int:
        return self.prompts * self.generations


@dataclass(frozen=True)
class Refit:
    """A published refit time of a layout (NeMo-RL's resharded NCCL)."""

    label: str
    model: str
    gpu: str
    gen_tp: int
    low: float
    high: float
    fp8: bool = False

    @property
    def seconds(self) -> float:
        return (self.low + self.high) / 2


DS, Q235, Q30 = "deepseek_v3", "qwen3_235b_a22b", "qwen3_30b_a3b"
STEPS = [
    NemoRun("DeepSeek-V3, 256 H100, on-policy", DS, "h100", 256, 0, 32, (1, 1, 16, 16), 32, 16, 1536, 701, 134,
            recipe="grpo-deepseek-v3-32n8g"),
    NemoRun("DeepSeek-V3, 512 H100, on-policy", DS, "h100", 512, 0, 32, (1, 1, 16, 16), 32, 16, 1536, 697, 111,
            recipe="grpo-deepseek-v3-64n8g"),
    NemoRun("DeepSeek-V3, 256+256 H100, 1-step off", DS, "h100", 512, 256, 32, (1, 1, 16, 16), 32, 16, 1536, 710,
            64.1, off_policy=1, gen_util=0.8, recipe="grpo-deepseek-v3-64n8g-async-1off"),
    NemoRun("DeepSeek-V3 FP8, 256+256 H100, 1-step off", DS, "h100", 512, 256, 16, (1, 1, 16, 16), 32, 16, 1536,
            721, 59.2, off_policy=1, gen_util=0.8, fp8=True, max_num_seqs=32,
            recipe="grpo-deepseek-v3-64n8g-fp8-async-1off"),
    NemoRun("Qwen3-235B, 128 H100, on-policy", Q235, "h100", 128, 0, 16, (2, 2, 16, 8), 16, 32, 8192, 5698, 395,
            recipe="grpo-qwen3-235b-16n8g"),
    NemoRun("Qwen3-235B, 256 H100, on-policy", Q235, "h100", 256, 0, 16, (2, 2, 16, 8), 16, 32, 8192, 5713, 312,
            recipe="grpo-qwen3-235b-32n8g"),
    NemoRun("Qwen3-235B, 128+128 H100, 1-step off", Q235, "h100", 256, 128, 8, (4, 1, 16, 8), 16, 32, 8192, 5721,
            231, off_policy=1, gen_util=0.8, recipe="grpo-qwen3-235b-32n8g-async-1off"),
    NemoRun("Qwen3-30B-A3B, 32 H100, on-policy", Q30, "h100", 32, 0, 2, (1, 1, 8, 1), 64, 32, 4096, 3203, 192,
            async_engine=False, recipe="grpo-qwen3-30ba3b-4n8g"),
    NemoRun("Qwen3-30B-A3B, 16+16 H100, 1-step off", Q30, "h100", 32, 16, 2, (1, 1, 8, 2), 64, 32, 4096, 3201, 152,
            off_policy=1, gen_util=0.8, recipe="grpo-qwen3-30ba3b-4n8g-async-1off"),
    NemoRun("Qwen3-30B-A3B, 128+64 H100, 8-step off", Q30, "h100", 192, 64, 2, (1, 1, 8, 1), 64, 32, 4096, 3206,
            34.5, off_policy=8, gen_util=0.8, recipe="grpo-qwen3-30ba3b-24n8g-async-8off"),
    NemoRun("DeepSeek-V3, 128 GB200, on-policy", DS, "gb200", 128, 0, 32, (1, 1, 16, 8), 32, 16, 1536, 711, 108,
            gen_util=0.3, recipe="grpo-deepseek-v3-32n4g"),
    NemoRun("DeepSeek-V3, 256 GB200, on-policy", DS, "gb200", 256, 0, 32, (1, 1, 16, 8), 32, 16, 1536, 700, 98.7,
            gen_util=0.3, recipe="grpo-deepseek-v3-64n4g"),
    NemoRun("DeepSeek-V3, 128+128 GB200, 1-step off", DS, "gb200", 256, 128, 16, (1, 1, 16, 8), 32, 16, 1536, 708,
            61.7, off_policy=1, gen_util=0.8, recipe="grpo-deepseek-v3-64n4g-async-1off"),
    NemoRun("Qwen3-235B, 64 GB200, on-policy", Q235, "gb200", 64, 0, 8, (2, 2, 16, 4), 16, 32, 8192, 5709, 286,
            gen_util=0.4, recipe="grpo-qwen3-235b-16n4g"),
    NemoRun("Qwen3-235B, 128 GB200, on-policy", Q235, "gb200", 128, 0, 8, (2, 2, 16, 4), 16, 32, 8192, 5693, 345,
            recipe="grpo-qwen3-235b-32n4g"),
    NemoRun("Qwen3-235B, 64+64 GB200, 1-step off", Q235, "gb200", 128, 64, 8, (4, 1, 16, 4), 16, 32, 8192, 5705,
            278, off_policy=1, gen_util=0.8, recipe="grpo-qwen3-235b-32n4g-async-1off"),
    NemoRun("Qwen3-30B-A3B, 16 GB200, on-policy", Q30, "gb200", 16, 0, 1, (1, 1, 16, 1), 64, 32, 4096, 3199, 221,
            async_engine=False, recipe="grpo-qwen3-30ba3b-4n4g"),
    NemoRun("Qwen3-30B-A3B, 8+8 GB200, 1-step off", Q30, "gb200", 16, 8, 1, (1, 1, 8, 1), 64, 32, 4096, 3197, 301,
            off_policy=1, gen_util=0.8, recipe="grpo-qwen3-30ba3b-4n4g-async-1off"),
]  # fmt: skip
REFITS = [
    Refit("DeepSeek-V3 BF16, PP16xEP16 -> TP32xDP8, H100", DS, "h100", 32, 2.39, 2.83),
    Refit("DeepSeek-V3 BF16, PP16xEP16 -> TP32xDP8, GB200", DS, "gb200", 32, 1.93, 2.59),
    Refit("Qwen3-30B BF16, EP8xPP2 -> TP8xDP2, H100", Q30, "h100", 8, 0.74, 1.00),
    Refit("Qwen3-30B FP8, EP8xDP2 -> TP2xDP8, H100", Q30, "h100", 2, 2.90, 4.00, fp8=True),
]
GPU_MEMORY = {"h100": 80, "gb200": 186}


@dataclass(frozen=True)
class Calibration:
    """One published configuration, seen three ways: a serial (on-policy) step, an overlapped
    (off-policy) step and a refit; and a measured MFU that picks between two splits that both
    reproduce the steps."""

    serial: str
    overlapped: str
    refit: str
    measured_mfu: float
    mfu_source: str


CALIBRATIONS = {
    "qwen3_30b_a3b": Calibration(
        "Qwen3-30B-A3B, 32 H100, on-policy", "Qwen3-30B-A3B, 16+16 H100, 1-step off",
        "Qwen3-30B BF16, EP8xPP2 -> TP8xDP2, H100", 118 / 989,
        "Megatron-Bridge's Qwen3-30B-A3B on 16 H100, 118 TFLOP/s per GPU",
    ),
    "deepseek_v3": Calibration(
        "DeepSeek-V3, 256 H100, on-policy", "DeepSeek-V3, 256+256 H100, 1-step off",
        "DeepSeek-V3 BF16, PP16xEP16 -> TP32xDP8, H100", 338 / 989,
        "Megatron-Bridge's DeepSeek-V3 on 1,024 H100, 338 TFLOP/s per GPU",
    ),
}  # fmt: skip
SHIPPED = "qwen3_30b_a3b"
"""The calibration `moe_rl.planner.step_time.FITTED` holds."""
GPUS_PER_NODE = {"h100": 8, "gb200": 4}


def run_overrides(run: NemoRun) -> list[str]:
    """The published run's settings as overrides of the shipped recipe of its model."""
    per_node = GPUS_PER_NODE[run.gpu]
    train_gpus = run.gpus - run.gen_gpus
    tp, cp, ep, pp = run.train
    engines = (run.gen_gpus or run.gpus) // run.gen_tp
    out = [
        f"cluster.gpu_type={run.gpu}", f"cluster.gpu_memory_gib={GPU_MEMORY[run.gpu]}",
        f"cluster.gpus_per_node={per_node}", f"cluster.nodes={run.gpus // per_node}",
        f"cluster.trainer_nodes={train_gpus // per_node}", f"cluster.rollout_nodes={run.gen_gpus // per_node}",
        f"parallel.trainer_world_size={train_gpus}", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.context_parallel_size={cp}", f"parallel.expert_model_parallel_size={ep}",
        f"parallel.pipeline_model_parallel_size={pp}", f"parallel.sequence_parallel={tp > 1}",
        f"rollout.quant={'fp8_block128' if run.fp8 else 'bf16'}", f"rollout.batch_size={run.samples}",
        f"rollout.group_size={run.generations}", f"rollout.num_engines={engines}",
        f"rollout.tensor_parallel_size={run.gen_tp}", f"rollout.gpu_memory_utilization={run.gen_util}",
        f"rollout.max_model_len={run.max_len}", f"data.max_prompt_len={PROMPT_BUDGET}",
        f"rollout.max_new_tokens={run.max_len - PROMPT_BUDGET}",
        f"trainer.num_mini_batches={max(1, run.samples // run.train_batch)}",
        f"trainer.max_tokens_per_microbatch={run.max_len}", "algo.kl.coef=0.01",
        f"cluster.mean_length_fraction={run.avg_len / run.max_len:.4f}",
        f"trainer.recompute_activations={run.model != Q30}",
    ]  # fmt: skip
    if run.off_policy:  # N steps off: NeMo-RL's trainer overlaps all of its step, π_old and the
        # reference included, with the generation, as our depth N + 1 does (depth 1 computes π_old
        # first); its engines hold N batches (`predict`'s batches_in_flight), and in-flight weight
        # updates never drain them
        depth = run.off_policy + 1
        out += ["run.mode=async", f"run.async_depth={depth}", f"run.max_staleness={depth}",
                "rollout.inflight_updates=true"]  # fmt: skip
    return out


def run_config(run: NemoRun | Refit, overrides: list[str] | None = None) -> RecipeConfig:
    if isinstance(run, Refit):
        overrides = [
            f"cluster.gpu_type={run.gpu}",
            f"rollout.quant={'fp8_block128' if run.fp8 else 'bf16'}",
            f"rollout.tensor_parallel_size={run.gen_tp}",
        ]
    return load_recipe(
        RECIPES / f"{run.model}.yaml", overrides if overrides is not None else run_overrides(run)
    )


def predict(run: NemoRun, eff: Efficiency, machine: Chip | None = None) -> StepTime:
    """The model's step for a published run: its refit resharded, its colocated phases releasing
    everything the trainer holds (NeMo-RL offloads the optimizer and the weights); ``machine``: in
    place of the run's chip."""
    config, sync, released = _run_inputs(run)
    # NeMo-RL's async GRPO (nemo_rl/algorithms/async_utils.py, v0.6.0): at most
    # num_prompts_per_step * max_trajectory_age_steps prompt groups in flight, N batches
    return step_time(config, sync, released, eff, batches_in_flight=run.off_policy or None, machine=machine)


# vLLM's scheduler runs at most ``max_num_seqs`` sequences at once. Unset, vLLM (NeMo-RL v0.6 pins
# vllm==0.17.1) takes it from ``EngineArgs.get_batch_defaults`` by usage context
# (vllm/engine/arg_utils.py, ``_set_default_max_num_seqs_and_batched_tokens_args``): 1,024 for the
# offline ``vllm.LLM`` (``UsageContext.LLM_CLASS``) on a GPU of 70 GiB or more, while ``AsyncLLM``
# (``from_engine_args``' ``UsageContext.ENGINE_CONTEXT``, in no table) falls back to
# ``SchedulerConfig.DEFAULT_MAX_NUM_SEQS``, 128 (vllm/config/scheduler.py). NeMo-RL builds
# ``AsyncLLM`` with ``vllm_cfg.async_engine`` (nemo_rl/models/generation/vllm/vllm_worker_async.py),
# else ``vllm.LLM`` (vllm_worker.py), and passes ``vllm_kwargs`` through.
VLLM_LLM_CLASS_MAX_NUM_SEQS = 1024
VLLM_ENGINE_MAX_NUM_SEQS = 128


def engine_max_seqs(run: NemoRun) -> int:
    """The most sequences one of the run's vLLM engines decodes at once."""
    if run.max_num_seqs is not None:
        return run.max_num_seqs
    return VLLM_ENGINE_MAX_NUM_SEQS if run.async_engine else VLLM_LLM_CLASS_MAX_NUM_SEQS


def predict_capped(run: NemoRun, eff: Efficiency) -> StepTime:
    """`predict` with the run's engines bounded by vLLM's ``max_num_seqs`` (`engine_max_seqs`): what
    the comparison leaves out, and why (docs/plan_model.md, where it misses)."""
    config, sync, released = _run_inputs(run)
    bound = engine_max_seqs(run)
    return step_time(
        config, sync, released, eff, batches_in_flight=run.off_policy or None, max_num_seqs=bound
    )


# NVIDIA's MLPerf Training v5.0 submissions (NVIDIA technical blog, "NVIDIA Blackwell Delivers up to
# 2.6x Higher Performance in MLPerf Training v5.0", June 2025): GB200 NVL72 trained Llama 3.1 405B
# 2.2x faster than Hopper at the same GPU count; a tuned workload's GB200 over H100, per GPU.
MLPERF_GB200_OVER_H100 = 2.2


def scaled_chip(gpu: GpuType, scale: float) -> Chip:
    """The chip with its FLOP/s (every precision) and memory bandwidth × ``scale``; its links as they
    are."""
    chip = MACHINES[gpu]
    return replace(
        chip, bf16_tflops=chip.bf16_tflops * scale, fp8_tflops=chip.fp8_tflops * scale,
        fp32_tflops=chip.fp32_tflops * scale, memory_gbps=chip.memory_gbps * scale,
    )  # fmt: skip


def chip_scale_within(run: NemoRun, eff: Efficiency, low: float = 0.5) -> float:
    """The largest scale of the run's chip (`scaled_chip`) at which the model's step is ``low`` of the
    published one (1.0 when it already is at the datasheet): how much slower the chip would have to
    be for a run the model makes too fast to come within the target."""
    if predict(run, eff).seconds >= low * run.seconds:
        return 1.0
    below, above = 0.01, 1.0  # the step at ``below`` is slow enough, at ``above`` too fast
    for _ in range(40):
        mid = (below + above) / 2
        slow_enough = predict(run, eff, scaled_chip(GpuType(run.gpu), mid)).seconds >= low * run.seconds
        below, above = (mid, above) if slow_enough else (below, mid)
    return below


@functools.cache
def _run_inputs(run: NemoRun) -> tuple[RecipeConfig, SyncCost, float]:
    config = run_config(run)
    released = estimate(config).trainer.static if run.gen_gpus == 0 else 0.0
    return config, gathered_sync_cost(config, count_params(config.model), machine_of(config)), released


def predict_refit(refit: Refit, eff: Efficiency) -> float:
    config = run_config(refit)
    cost = resharded_sync_cost(config, count_params(config.model), machine_of(config))
    return transfer_seconds(cost.nbytes, cost.gbps, eff.sync)


def fit(name: str = SHIPPED) -> Efficiency:
    """The three factors from the three figures of one configuration (`CALIBRATIONS`). The refit
    fixes η_sync. A phase's time is its work at efficiency 1 over its factor plus what no factor
    scales (the collectives' latency and bytes), so for each MFU the serial step, the sum of every
    phase, fixes η_gen; the MFUs at which the overlapped step (the run mode's overlap of the two
    sides) then matches its figure are found along a scan and refined by bisection. Of those, the
    one nearest the configuration's measured MFU."""
    c = CALIBRATIONS[name]
    refit = next(r for r in REFITS if r.label == c.refit)
    serial = next(r for r in STEPS if r.label == c.serial)
    overlapped = next(r for r in STEPS if r.label == c.overlapped)
    sync = predict_refit(refit, Efficiency(1.0, 1.0, 1.0)) / refit.seconds

    def eta_gen(mfu: float) -> float:  # the serial step's generation is ``a / η + b``
        one, half = predict(serial, Efficiency(1.0, mfu, sync)), predict(serial, Efficiency(0.5, mfu, sync))
        a = _generation_s(half) - _generation_s(one)
        rest = one.seconds - _generation_s(one) + (_generation_s(one) - a)
        return a / (serial.seconds - rest) if serial.seconds > rest else -1.0

    def miss(mfu: float) -> float:
        eta = eta_gen(mfu)
        return (
            predict(overlapped, Efficiency(eta, mfu, sync)).seconds - overlapped.seconds
            if eta > 0
            else math.nan
        )

    grid = [10 ** (-3 + 3 * i / 240) for i in range(241)]  # MFU from 0.001 to 1
    values = [miss(x) for x in grid]
    candidates = []
    for (lo, a), (hi, b) in zip(zip(grid, values), zip(grid[1:], values[1:]), strict=False):
        if math.isnan(a) or math.isnan(b) or (a > 0) == (b > 0):
            continue
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (miss(mid) > 0) == (a > 0) else (lo, mid)
        candidates.append(Efficiency(eta_gen(lo), lo, sync))
    if not candidates:
        raise SystemExit(f"no factors reproduce the figures of {name}")
    return min(candidates, key=lambda e: abs(e.train_mfu - c.measured_mfu))


def rounded(eff: Efficiency) -> Efficiency:
    """The factors to three significant digits, as `FITTED` holds them."""
    return Efficiency(*(float(f"{x:.3g}") for x in (eff.generation, eff.train_mfu, eff.sync)))


def _generation_s(t: StepTime) -> float:
    return sum(p.seconds for p in t.phases if p.name in ("prefill", "decode"))


def _passes_s(t: StepTime) -> float:
    return sum(p.seconds for p in t.phases if p.name in ("π_old", "reference", "training"))


# ---------------------------------------------------------------------------------------------- tiny
TINY_PHASES = [
    ("generation", ("prefill", "decode"), "time/rollout_s"),
    ("π_old (+ reference)", ("π_old", "reference"), "time/old_logp_s"),
    ("training", ("training",), "time/train_s"),
    ("weight sync", ("weight sync",), "time/sync_s"),
]


def tiny_run(run_dir: Path | None) -> Path:
    """A finished run of the tiny recipe: ``run_dir``, or one trained now in a temporary folder."""
    if run_dir is not None:
        return run_dir
    out = Path(tempfile.mkdtemp(prefix="plan-model-"))
    cmd = [sys.executable, "-m", "launch.cli", "train", "recipes/tiny_moe.yaml", f"run.output_dir={out}",
           "logging.progress=false"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return out / "tiny_moe"


def tiny_measured(run_dir: Path) -> dict[str, float]:
    """Medians of the tiny run's ``time/*`` and ``perf/peak_tflops`` after its first two steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[2:] or rows
    keys = {k for row in rows for k in row if k.startswith("time/")} | {"perf/peak_tflops"}
    return {k: statistics.median(r[k] for r in rows if isinstance(r.get(k), (int, float))) for k in keys}


def tiny_predicted() -> StepTime:
    config = load_recipe(RECIPES / "tiny_moe.yaml")
    return step_time(config, estimate(config).sync, 0.0)


# ------------------------------------------------------------------------------------------ measure
def measure_cpu() -> tuple[float, float, float]:
    """This CPU: an fp32 1024³ matrix product (TFLOP/s, best of three), memory traffic and copy rate
    of a 256 MiB copy (GB/s)."""
    import torch

    from moe_rl.trainer.perf import matmul_tflops

    tflops = max(matmul_tflops(torch.device("cpu"), torch.float32) for _ in range(3))
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    copied = a.numel() * 4 / best / 1e9
    return tflops, 2 * copied, copied


# ------------------------------------------------------------------------------------------- tables
def _ratio(predicted: float, measured: float) -> str:
    r = predicted / measured
    return f"{r:.2f}" + ("" if 0.5 <= r <= 2 else " **miss**")


def _offload_s(t: StepTime) -> float:
    return sum(p.seconds for p in t.phases if p.name == "offload")


def _calibrated(label: str, name: str = SHIPPED) -> bool:
    c = CALIBRATIONS[name]
    return label in (c.serial, c.overlapped, c.refit)


def _settings(run: NemoRun) -> str:
    tp, cp, ep, pp = run.train
    where = f"{run.gpus - run.gen_gpus} + {run.gen_gpus}" if run.gen_gpus else f"{run.gpus} colocated"
    policy = f"{run.off_policy}-step off" if run.off_policy else "on-policy"
    quant = ", FP8" if run.fp8 else ""
    return (
        f"{where} {run.gpu.upper()}; engines TP {run.gen_tp}{quant}; trainer TP {tp} CP {cp} EP {ep} PP {pp}; "
        f"{run.prompts}x{run.generations} samples, {run.max_len:,} / mean {run.avg_len:,} tokens; {policy}"
    )


def step_rows(eff: Efficiency) -> list[list[str]]:
    rows = []
    for run in STEPS:
        t = predict(run, eff)
        rows.append([
            run.label + (" (fit)" if _calibrated(run.label) else ""), _settings(run), f"`{run.recipe}`",
            f"{run.seconds:g}", f"{t.seconds:.1f}", _ratio(t.seconds, run.seconds), f"{_generation_s(t):.1f}",
            f"{_passes_s(t):.1f}", f"{t.phase('weight sync').seconds:.1f}", f"{_offload_s(t):.1f}",
        ])  # fmt: skip
    return rows


def refit_rows(eff: Efficiency) -> list[list[str]]:
    return [
        [r.label + (" (fit)" if _calibrated(r.label) else ""), f"{r.low:g}–{r.high:g}",
         f"{predict_refit(r, eff):.2f}", _ratio(predict_refit(r, eff), r.seconds)]
        for r in REFITS
    ]  # fmt: skip


def ratios(eff: Efficiency) -> list[float]:
    return [predict(r, eff).seconds / r.seconds for r in STEPS]


def tiny_rows(measured: dict[str, float]) -> list[list[str]]:
    t = tiny_predicted()
    rows = []
    for label, names, key in TINY_PHASES:
        predicted = sum(p.seconds for p in t.phases if p.name in names)
        bound = next((str(p.bound) for p in t.phases if p.name in names), "")
        rows.append([label, f"`{key}`", f"{measured.get(key, 0.0) * 1e3:.1f}", f"{predicted * 1e3:.2f}", bound,
                     f"{predicted / measured[key]:.3g}" if measured.get(key) else "–"])  # fmt: skip
    step = measured.get("time/step_s", 0.0)
    rows.append(
        [
            "step",
            "`time/step_s`",
            f"{step * 1e3:.1f}",
            f"{t.seconds * 1e3:.2f}",
            "",
            f"{t.seconds / step:.3g}",
        ]
    )
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def phase_table(recipe: str) -> str:
    """The plan's phase table of a shipped recipe, as markdown."""
    config = load_recipe(RECIPES / f"{recipe}.yaml")
    t = estimate(config).step
    rows = [
        [p.name, f"{p.seconds:,.1f}", "beside" if p.overlapped else f"{p.seconds / t.seconds:.0%}", p.bound,
         p.detail.replace("|", "/")]
        for p in t.phases
    ]  # fmt: skip
    rows.append(["**step**", f"**{t.seconds:,.1f}**", "", "", t.how])
    c, r = config.cluster, config.rollout
    head = (
        f"`recipes/{recipe}.yaml`: {c.nodes} nodes of {c.gpus_per_node} {t.machine.name.upper()} "
        f"({c.trainer_nodes} trainer, {c.rollout_nodes} rollout), {r.num_engines} {r.engine} engines of TP "
        f"{r.tensor_parallel_size} ({config.quant.name}), {r.batch_size} samples of up to "
        f"{config.data.max_prompt_len + r.max_new_tokens:,} tokens, run.mode={config.run.mode}"
    )
    return head + "\n\n" + table(["phase", "s", "share", "bound", "what"], rows)


def machines_table() -> str:
    rows = [
        [m.name, f"{m.bf16_tflops:g}", f"{m.fp8_tflops:g}", f"{m.fp32_tflops:g}", f"{m.memory_gbps:g}",
         f"{m.nvlink_gbps:g}", f"{m.network_gbps:g}", f"{m.host_gbps:g}", str(m.nvlink_domain)]
        for m in MACHINES.values()
    ]  # fmt: skip
    return table(["chip", "bf16", "fp8", "fp32 (TF32)", "memory GB/s", "NVLink GB/s", "network GB/s",
                  "host link GB/s", "NVLink domain"], rows)  # fmt: skip


SOURCES = """\
- **H100** (SXM5): NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979, FP8 3,958, TF32 989 TFLOPS
  with sparsity (halved here: dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s and PCIe Gen5
  128 GB/s (both directions; one direction here); DGX H100 datasheet: eight ConnectX-7 400 Gb/s, one
  per GPU (50 GB/s).
- **H200** (SXM): NVIDIA H200 Tensor Core GPU datasheet: the H100's TFLOPS, 141 GB HBM3e at
  4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; DGX H200 datasheet: eight ConnectX-7 400 Gb/s.
- **B200**: NVIDIA DGX B200 datasheet, per GPU of eight: 72 PFLOPS FP8 training (sparse) → 4.5 PFLOPS
  dense, BF16 2.25, TF32 1.1; 1,440 GB of HBM3e at 64 TB/s → 180 GB at 8 TB/s; NVLink 5 at 1.8 TB/s
  (both directions); eight ConnectX-7 400 Gb/s; PCIe Gen5 x16 to the host.
- **GB200**: NVIDIA GB200 NVL72 datasheet, per GPU of 72: FP8 720 and BF16 360 PFLOPS (sparse) →
  5.0 and 2.5 PFLOPS dense, TF32 1.25; 13.4 TB of HBM3e at 576 TB/s → 186 GB at 8 TB/s; NVLink
  130 TB/s → 1.8 TB/s per GPU across the 72-GPU domain; NVLink-C2C 900 GB/s (both directions) from a
  Grace CPU to its two GPUs (225 GB/s per GPU and direction); one ConnectX-7 400 Gb/s per GPU.
- **cpu**: the project's machine (two cores of an AMD EPYC), measured by
  `bench/plan_model.py --measure`: an fp32 1024³ matrix product (`moe_rl.trainer.perf.matmul_tflops`,
  what the tiny run logs as `perf/peak_tflops`), used for every precision (the tiny recipe computes
  in fp32), and a 256 MiB copy: 17 GB/s of memory traffic, 8.7 GB/s copied (the CPU's shared-memory
  "links")."""


def document(eff: Efficiency, measured: dict[str, float]) -> str:
    """docs/plan_model.md."""
    c = CALIBRATIONS[SHIPPED]
    ds = CALIBRATIONS["deepseek_v3"]
    ds_eff = fit("deepseek_v3")
    shipped = ratios(eff)
    other = ratios(ds_eff)
    within = sum(0.5 <= r <= 2 for r in shipped)
    other_within = sum(0.5 <= r <= 2 for r in other)
    by_label = {r.label: x for r, x in zip(STEPS, shipped, strict=True)}
    dsv3_h100 = [x for r, x in zip(STEPS, shipped, strict=True) if r.model == DS and r.gpu == "h100"]
    on_chip = {
        chip: [x for r, x in zip(STEPS, shipped, strict=True) if r.gpu == chip] for chip in ("h100", "gb200")
    }
    h100_rows, gb200 = on_chip["h100"], on_chip["gb200"]
    h100_within, gb200_within = (sum(0.5 <= x <= 2 for x in rows) for rows in (h100_rows, gb200))
    ds256 = next(r for r in STEPS if r.label == "DeepSeek-V3, 256 H100, on-policy")
    ds_comm = _generation_s(
        predict(ds256, Efficiency(1e9, 1e9, 1e9))
    )  # the collectives: no factor scales them
    ds_refit = predict(ds256, eff).phase("weight sync").seconds
    q30_refit = predict(next(r for r in STEPS if r.label == c.serial), eff).phase("weight sync").seconds
    misses = [r.label for r, x in zip(STEPS, shipped, strict=True) if not 0.5 <= x <= 2]
    other_misses = [r.label for r, x in zip(STEPS, other, strict=True) if not 0.5 <= x <= 2]
    eight = next(r for r in STEPS if r.off_policy == 8)
    config, sync, released = _run_inputs(eight)
    one_batch = step_time(config, sync, released, eff, batches_in_flight=1).seconds / eight.seconds
    depth_held = step_time(config, sync, released, eff).seconds / eight.seconds
    sensitivity = table(
        ["run", f"fitted on {SHIPPED} (shipped)", "fitted on deepseek_v3"],
        [[r.label, f"{a:.2f}", f"{b:.2f}"] for r, a, b in zip(STEPS, shipped, other, strict=True)],
    )
    by_seconds = {r.label: r.seconds for r in STEPS}
    pairs = [
        ("DeepSeek-V3, 256 H100, on-policy", "DeepSeek-V3, 256 GB200, on-policy"),
        ("Qwen3-235B, 128 H100, on-policy", "Qwen3-235B, 128 GB200, on-policy"),
    ]
    same_count = " and ".join(
        f"{by_seconds[h] / by_seconds[g]:.2f}× faster ({g.split(',')[0]}: {by_seconds[g]:g} s against {by_seconds[h]:g} s)"
        for h, g in pairs
    )
    q235 = {r.label: r for r in STEPS if r.model == Q235 and r.gpu == "gb200"}
    q235_128_refit = predict(q235["Qwen3-235B, 128 GB200, on-policy"], eff).phase("weight sync").seconds
    q235_64_refit = predict(q235["Qwen3-235B, 64 GB200, on-policy"], eff).phase("weight sync").seconds
    gb30 = next(r for r in STEPS if r.label == "Qwen3-30B-A3B, 8+8 GB200, 1-step off")
    h30 = next(r for r in STEPS if r.label == c.overlapped)
    gb_gen, gb_gen_capped = _generation_s(predict(gb30, eff)), _generation_s(predict_capped(gb30, eff))
    gb_capped = predict_capped(gb30, eff).seconds / gb30.seconds
    h_gen, h_gen_capped = _generation_s(predict(h30, eff)), _generation_s(predict_capped(h30, eff))
    peak = measured.get("perf/peak_tflops", 0.0)
    cpu = MACHINES[GpuType.CPU]
    h100, gb200_chip = MACHINES[GpuType.H100], MACHINES[GpuType.GB200]
    gb_flops, gb_memory = gb200_chip.bf16_tflops / h100.bf16_tflops, gb200_chip.memory_gbps / h100.memory_gbps
    gb_misses = [(r, chip_scale_within(r, eff)) for r in STEPS if r.gpu == "gb200" and r.label in misses]
    mlperf_within = sum(scale * gb_flops >= MLPERF_GB200_OVER_H100 for _, scale in gb_misses)
    gb_needed = "\n".join(
        f"    - {r.label}: {scale * gb_flops:.2f}× and {scale * gb_memory:.2f}×" for r, scale in gb_misses
    )
    return f"""# The step-time model of `moe-rl plan`

`moe-rl plan` prints, under **Step time**, what one RL step of a recipe costs phase by phase on the
cluster the recipe describes: the seconds of each phase, its share of the step, what bounds it
(compute, memory or network) and the numbers behind it, then the step and how its phases add up.
`moe-rl plan RECIPE --sweep KEY=V1,V2,...` prints one row per value of a key (the phases, the step,
the slowest phase and the plan's verdict); `cluster.rollout_nodes` also moves the engines (as many
of the recipe's TP as the nodes hold) and the node count, `cluster.trainer_nodes` the trainer's
world size. The model is `moe_rl/planner/step_time.py`; this page is generated, with every number on
it, by

```
.venv/bin/python bench/plan_model.py --write docs/plan_model.md
```

(it trains `recipes/tiny_moe.yaml` on the CPU for its `time/*` metrics, about a minute on two
cores; `--tiny-run RUN_DIR` reads a finished run instead; `--fit` prints the factors fitted again).

## The model

Inputs are the recipe's numbers and a table of chip constants. The longest sequence is `L =
data.max_prompt_len + R` (`R` the response budget); a rollout's mean prompt and response are
`cluster.mean_length_fraction` `f` of theirs (`p = f·max_prompt_len`, `r = f·R`). FLOPs are
`moe_rl.planner.flops`' (per token of the weight products, per causal query–key pair of attention);
bytes are `moe_rl.config.derived`'s (the rollout recipe's bytes per weight, the KV cache per token:
MLA's latent whole on every engine GPU, GQA's heads split over its TP; the tokens the cache holds).

| phase | bound | time |
|---|---|---|
| prefill | compute | an engine's samples (`ceil(prompts / engines) · group_size`) × their prompt's forward FLOPs, over its TP GPUs at the dense bf16 peak (fp8 when the recipe quantizes activations) × η_gen |
| decode | memory or compute | waves of as many sequences as the engine's KV cache holds at the mean length (none: *the phase cannot run*), each as long as the longest response; a step reads the GPU's share of the weights (the input embedding aside, and only the routed experts the batch reaches: `E·(1 − (1 − k/E)^b)` of `E` per MoE layer for `b` sequences in flight, `b` falling as sequences finish), every token its sequence's KV cache so far (`n·(p·r + r²/2)` token reads); the bytes over HBM × η_gen or the FLOPs over the peak × η_gen, the longer; with TP > 1, plus every step's two all-reduces a layer of the sequences in flight (NCCL's latency, below, and the bytes at the link's rate: NVLink within an NVLink domain, else the NIC; the prefill's over its prompt tokens). With the next batches waiting (`run.mode=async`, `run.async_depth` ≥ 2, engines on nodes of their own) the engine holds the prompts of `async_depth` batches, as many as its KV cache holds, and the wave stays full: `n·r/b` steps of `b` |
| offload | network (host link) | colocated with memory released: the trainer's gradients and optimizer state (and weights with `cluster.offload_params`) and, at `cluster.engine_sleep_level` 1, the engine's weights, to host memory and back, over the GPU's host link × η_sync |
| π_old, reference, training | compute | the batch's forward FLOPs at the mean length, ×1, ×1 (with `algo.kl.coef` > 0), ×3 (×4 with `trainer.recompute_activations`: the forward again in the backward; with LoRA less one forward of the frozen weight products, whose gradients are not computed), over the trainer's GPUs at the dense peak of `trainer.precision` × MFU (`cluster.train_mfu`); with expert parallelism plus the all-to-all of each token's hidden state to its top-k experts and back in every MoE layer (×1, ×1, ×2, ×3 with the recompute), the share bound for other NVLink domains through the NIC; all × the pipeline bubble `(m + PP − 1)/m` (`m` micro-batches per data-parallel rank and mini-batch) |
| weight sync | network (memory in one process) | the bytes that travel (the rollout recipe's on a quantized wire, bf16 into vLLM, else the trainer's tensors) through the route's narrowest link (`config/sync_plan.py`): an engine's NIC (buckets to other nodes), an engine GPU's host link (buckets through shared memory), each trainer GPU's NVLink or NIC as it gathers the whole model (`device_ipc`, `vllm_ipc`: NVLink when the ranks it gathers from lie within one NVLink domain; with a pipeline, Megatron's rank order spreads them over the whole trainer), trainer rank 0's NIC (`vllm_nccl`), a memory copy on the CPU; × η_sync |

The step: `run.mode=sync` (and `offline`) adds the phases. `async` with the engines on nodes of
their own overlaps the generation with the trainer (`moe_rl/orchestration/loop.py`): at
`run.async_depth` 1, `π_old + ref + max(generation, training) + sync` (`max(generation, training +
sync)` inside with `rollout.inflight_updates`); deeper, `max(generation [+ sync], π_old + ref +
training + sync)`. Colocated, the two share the GPUs and the phases add up in either mode. The
plan marks the overlapped side `beside`.

The collectives are the only terms no factor scales: their latency is NCCL's own model
(`src/graph/tuning.cc`, `ncclTopoTuneModel`, the LL protocol of small messages: a base of 3.6 µs
for a ring and 4.4 µs for a tree, a hop of 0.47 / 0.52 µs over NVLink, ×1.8 when the communicator
spans nodes, and 2.7 / 5.0 µs over the network; the lower of ring and tree), their bytes go at the
links' datasheet rates. A TP-32 engine over four H100 nodes pays 37.5 µs an all-reduce, 122 of
them a DeepSeek-V3 decode step; a TP-2 engine within a node 4.5 µs. NeMo-RL v0.6's refit, in the
comparison with its published runs below, is collectives too (a gather and a broadcast).

Bad input: an unknown `cluster.gpu_type` is refused when the recipe loads, in one line naming the
known ones; `auto` with a memory size no known GPU has says to set `cluster.gpu_type`; a KV cache
that holds no full sequence, or a sync route the layout refuses, is said in place of a time.

## Constants

Dense peak TFLOP/s, and GB/s per GPU in one direction:

{machines_table()}

{SOURCES}

## The efficiency factors

One factor per phase: η_gen (prefill and decode), the training MFU (π_old, reference, training;
a recipe overrides it with `cluster.train_mfu`, whose default is this fit), η_sync (weight sync and
offload). They are fitted on **one published configuration**, NeMo-RL v0.6's Qwen3-30B-A3B GRPO on
four nodes of 8 H100 (64 prompts × 32 samples of up to 4,096 tokens), published three ways: the
on-policy step on 32 colocated GPUs ({next(r.seconds for r in STEPS if r.label == c.serial):g} s), the one-step-off step on
16 + 16 GPUs ({next(r.seconds for r in STEPS if r.label == c.overlapped):g} s) and its refit (0.74–1.00 s). Three figures, three factors: the
refit fixes η_sync; the serial step, the sum of every phase, and the overlapped step, the longer of
its two sides, fix η_gen and the MFU (the collectives, at their own rates, are outside the factors:
among them the refit inside those steps, which is v0.6's gather and broadcast, below, not the
resharded transfer of the refit figure, a later NeMo-RL feature).
Where more than one split reproduces both steps, the fit keeps the one whose MFU is nearest the
measured one ({c.mfu_source}: {c.measured_mfu:.3f}).

| factor | value |
|---|---|
| η_gen | {eff.generation:.3g} |
| training MFU | {eff.train_mfu:.3g} |
| η_sync | {eff.sync:.3g} |

Every other row below is a prediction. Why this configuration: it is the regime of the recipes this
project ships (engines within a node or two, one pipeline stage, micro-batches of thousands of
tokens). NeMo-RL's DeepSeek-V3 runs are not (below); fitted on them instead, the model meets the
target on {other_within} of {len(STEPS)} rows against {within} (the sensitivity table), missing {"; ".join(other_misses)}
where the shipped fit misses {"; ".join(misses)}. Neither fit holds
both families within 2×: the model has one factor per phase, and the two families need factors
{eff.generation / ds_eff.generation:.1f}× (generation) and {eff.train_mfu / ds_eff.train_mfu:.1f}× (training) apart.

## Against the published runs

NeMo-RL v0.6's performance summary (`docs/about/performance-summary.md`), every GRPO row of the
three MoE models, each with the settings of its recipe
(`examples/configs/recipes/llm/performance/`, named in the table). Model / published within 0.5–2 is
the target; {within} of {len(STEPS)} rows meet it: {h100_within} of the {len(h100_rows)} on H100, {gb200_within} of the {len(gb200)} on GB200
(the misses, below).

{table(["run", "settings", "NeMo-RL recipe", "published s", "model s", "model / published", "generation s", "π_old + ref + training s", "sync s", "offload s"], step_rows(eff))}

Refit (NeMo-RL `docs/design-docs/nccl-reshard-refit.md`, resharded NCCL: each engine GPU takes its
own shard):

{table(["refit", "published s", "model s", "model / published"], refit_rows(eff))}

How a published run becomes a recipe: the shipped recipe of its model with the run's GPUs, layouts,
samples and lengths; the longest prompt 256 tokens and the rest of the run's total length the
response budget; `cluster.mean_length_fraction` its published mean length over its total; the
engines' `rollout.gpu_memory_utilization` the recipe's at the v0.6.0 tag; NeMo-RL's
default KL penalty (0.01), so a reference pass; a colocated step releases everything the trainer
holds and the engines sleep at level 1 (NeMo-RL offloads the optimizer and the weights); an
N-step-off run is `run.mode=async` with `run.async_depth` N + 1 and in-flight updates (NeMo-RL's
trainer overlaps all of its step, π_old and reference included, with the generation), its engines
holding N batches at once (NeMo-RL v0.6 `nemo_rl/algorithms/async_utils.py`: at most
`num_prompts_per_step × max_trajectory_age_steps` prompt groups in flight, the next batch's groups
taking the places the last one's finished ones leave); `trainer.recompute_activations` as the NeMo-RL
recipe's `activation_checkpointing` (DeepSeek-V3 and Qwen3-235B: on; Qwen3-30B-A3B: off). FP8
training runs as bf16 here.

Its refit is NeMo-RL v0.6's, which the published steps ran (the resharded transfer of the refit
table came after v0.6.0): `refit_policy_generation` in `nemo_rl/algorithms/grpo.py` takes the
weights from Megatron-Bridge's `export_hf_weights`, which broadcasts every tensor from the pipeline
stage that holds it to every stage and all-gathers the experts over the expert-parallel group, so
every trainer GPU receives the whole bf16 model; colocated, it hands them to its engine through
CUDA IPC; with the engines on nodes of their own, trainer rank 0 broadcasts them to every engine GPU
(`packed_broadcast_producer`, two buffers, so the broadcast of one overlaps the gathering of the
next). The gather goes over NVLink only when the ranks a GPU gathers from share one NVLink domain:
with a pipeline, Megatron's rank order (`tp-cp-ep-dp-pp`, the pipeline outermost) spreads them over
the whole trainer. Both are collectives, at the links' datasheet rates: {ds_refit:.1f} s a step for
DeepSeek-V3 (1.34 TB through each GPU's 400 Gb/s NIC), {q30_refit:.2f} s for the calibration's on-policy
run (EP 8 within a node, over NVLink).

### Where it misses, and why

- **DeepSeek-V3** (H100 {min(dsv3_h100):.2f}–{max(dsv3_h100):.2f}): within 2× once the refit is v0.6's. Its pipeline of
  16 stages spreads every GPU's gather over the trainer, so each step moves the whole bf16 model
  through every GPU's NIC ({ds_refit:.1f} s), on H100 and GB200 alike (the same 400 Gb/s NIC) and
  whatever the GPU count: the part of those steps that does not shrink as GPUs are added, which
  is why NeMo-RL's runs scale weakly ({by_seconds["DeepSeek-V3, 256 H100, on-policy"]:g} s on 256 H100, {by_seconds["DeepSeek-V3, 512 H100, on-policy"]:g} s on 512). The model is still
  {1 / max(dsv3_h100):.1f}–{1 / min(dsv3_h100):.1f}× too fast: its engines are TP 32 over four nodes (the 122 all-reduces of every decode step
  at NCCL's modelled 37.5 µs, {ds_comm:.1f} s of the on-policy step on 256 GPUs, are in) and its trainer a
  16-stage pipeline with expert parallelism across two nodes; fitted on its own three figures
  (sensitivity table) this configuration needs η_gen {ds_eff.generation:.3g} and an MFU of {ds_eff.train_mfu:.3g},
  {eff.generation / ds_eff.generation:.1f}× and {eff.train_mfu / ds_eff.train_mfu:.1f}× below the Qwen3-30B-A3B fit, and no sourced constant says
  where that goes (the experts' GEMMs get some 770 tokens each per micro-batch of 1,536 packed
  tokens, above the H100's roofline ridge of 295 FLOP per byte, so reading their weights does not
  bound them). Their engines decode without draft tokens, as the model does: the v0.6.0 recipes
  have no `speculative_config` (NeMo-RL added `deepseek_mtp` to them after that release).
- **GB200** ({min(gb200):.2f}–{max(gb200):.2f}; {gb200_within} of {len(gb200)} within 2×): the constants give a GB200 2.5× an H100's FLOP/s and 2.4× its memory
  bandwidth; on as many GPUs, NeMo-RL's GB200 steps are {same_count}, and per GPU
  its Qwen3-30B-A3B one-step-off run on 8 + 8 GB200 processes as many tokens a second as the one on
  16 + 16 H100 (1,406 and 1,414 tokens/s/GPU published). The model misses three runs:
  Qwen3-235B on-policy on 128 ({by_label["Qwen3-235B, 128 GB200, on-policy"]:.2f}), and the one-step-off runs of Qwen3-235B ({by_label["Qwen3-235B, 64+64 GB200, 1-step off"]:.2f}) and
  Qwen3-30B-A3B ({by_label["Qwen3-30B-A3B, 8+8 GB200, 1-step off"]:.2f}), all too fast. What the sources say of them:
  - *The recipes.* Each GB200 recipe inherits its H100 recipe and changes the GPUs a node, the
    layout (pipeline, expert parallelism, the engines' TP) and for some vLLM's memory share (the
    Qwen3-30B-A3B ones restate theirs, π_old in micro-batches of two sequences against four): the
    batch, the lengths, bf16 throughout, sequence packing with micro-batches of one packed sequence,
    vLLM's CUDA graphs (`enforce_eager: false`) and its async engine where the H100 run has it are
    the same. The Qwen3-235B on-policy run on 128 differs from
    the one on 64 only in its node count and vLLM's `gpu_memory_utilization` (0.6 against 0.4);
    its Qwen3-235B one-step-off run inherits the H100 run's 0.8 (NeMo-RL raised it to 0.88 after
    v0.6.0). The Qwen3-235B and DeepSeek-V3 test scripts of both chips set `NCCL_NVLS_ENABLE=0` (no NVLink SHARP),
    which the model never counted on. The 128-GPU runs span two 72-GPU NVLink domains, which the
    model already charges where it matters (the refit's gather through the NIC: {q235_128_refit:.1f} s against
    {q235_64_refit:.1f} s on 64); nothing sourced accounts for the published {by_seconds["Qwen3-235B, 128 GB200, on-policy"]:g} s on 128 against
    {by_seconds["Qwen3-235B, 64 GB200, on-policy"]:g} s on 64. The 8 + 8 Qwen3-30B-A3B recipe trains with EP 8 (the table says 16, the
    layout of the 16 + 16 run in NeMo-RL v0.5's summary, 136 s a step: half the GPUs in v0.6 take
    {by_seconds["Qwen3-30B-A3B, 8+8 GB200, 1-step off"] / 136:.1f}× as long).
  - *vLLM's batch bound.* NeMo-RL's `async_engine` builds vLLM's `AsyncLLM`, whose scheduler runs
    at most {VLLM_ENGINE_MAX_NUM_SEQS} sequences (vLLM's `SchedulerConfig` default: the engine's usage context has no
    entry in `EngineArgs.get_batch_defaults`), the offline `vllm.LLM` {VLLM_LLM_CLASS_MAX_NUM_SEQS:,}. Only the
    Qwen3-30B-A3B runs off policy hold more: bounded so (`step_time`'s `max_num_seqs`), the
    8 + 8 GB200 run's generation goes from {gb_gen:.0f} s to {gb_gen_capped:.0f} s ({by_label["Qwen3-30B-A3B, 8+8 GB200, 1-step off"]:.2f} to
    {gb_capped:.2f} of the published step), but the calibration's 16 + 16 H100 run's from {h_gen:.0f} s to
    {h_gen_capped:.0f} s, past its published {by_seconds[c.overlapped]:g} s step, and then no factors reproduce the calibration:
    the model's decode, a step's weight reads for every step, overstates what fewer sequences in
    flight cost. The comparison leaves the bound out.
  - *Megatron's own GB200 rate.* Megatron-Bridge's Qwen3-30B-A3B pretraining at 599 TFLOP/s per
    GB200 against 206 per H100 (`docs/performance-summary-archive.md`, 26.04.01) is MXFP8 at
    micro-batch 4 against FP8 at micro-batch 1. At the RL trainer's micro-batch of one sequence
    the same archive has Blackwell at 214 TFLOP/s (8 B200, MXFP8, dropless, 25.11) against 547 on
    8 GB200 at micro-batch 4, and H100 at 121 (FP8, micro-batch 2): about 1.8× an H100 rather than
    the peaks' 2.5×, and no bf16 figure at micro-batch 1 on GB200 to take a constant from.
  - *What the chip would have to be.* Scaling the GB200's FLOP/s and memory bandwidth together until
    each miss reaches half its published step, the model needs a GB200 of at most (its FLOP/s over an
    H100's and its memory bandwidth over an H100's; the datasheets give {gb_flops:.2f}× and {gb_memory:.2f}×):
{gb_needed}

    Tuned GB200 runs measure about what the datasheets say: NVIDIA's MLPerf Training v5.0 submissions
    ran Llama 3.1 405B pretraining {MLPERF_GB200_OVER_H100:g}× faster per GPU than Hopper at the same GPU count, and
    up to 2.6× across the benchmarks (NVIDIA technical blog, "NVIDIA Blackwell Delivers up to 2.6x
    Higher Performance in MLPerf Training v5.0", June 2025). A GB200 constant at that {MLPERF_GB200_OVER_H100:g}× (its
    memory bandwidth scaled alike) would bring {mlperf_within} of the {len(gb_misses)} within; the others need the chip
    slower than it measures there.
  The misses are these runs using less of a GB200 than NeMo-RL's H100 runs use of an H100; a factor
  fitted on H100 does not carry to them, and a chip constant should not absorb that, so the model
  keeps the datasheet.
- **Qwen3-30B-A3B eight steps off on 128 + 64 H100** ({by_label["Qwen3-30B-A3B, 128+64 H100, 8-step off"]:.2f}) is within: with its engines
  holding one batch at a time it would be {one_batch:.2f}× the published step; a trajectory may be eight
  versions old, so NeMo-RL's engines hold the prompts of eight steps, as many as their KV cache takes
  (some 210 sequences each at 0.8 of an H100), and decode those at once: the same weights read a
  step serve several times the tokens. (Holding the {eight.off_policy + 1} batches of `run.async_depth`
  {eight.off_policy + 1} instead: {depth_held:.2f}.)
- **Refits** (the table): the resharded transfer is the shard's bytes through one NIC at η_sync;
  its fixed costs (per-tensor calls, the FP8 recipe's quantization) are folded into η_sync, so a
  refit whose bytes differ much from the calibration's misses by the share of those costs.

### Sensitivity: fitted on DeepSeek-V3 instead

Fitted on DeepSeek-V3's three figures (on-policy on 256 H100, one step off on 256 + 256, the refit
of that layout; {ds.mfu_source} as the tie-break): η_gen {ds_eff.generation:.3g}, MFU {ds_eff.train_mfu:.3g},
η_sync {ds_eff.sync:.3g}; {other_within} of {len(STEPS)} rows within 2× (against {within} with the shipped fit).
Model / published under each fit:

{sensitivity}

## The project's own run: the tiny recipe on the CPU

`moe-rl train recipes/tiny_moe.yaml` (30 steps, one process, the Megatron engine), the median of
each `time/*` metric after the first two steps, against the model of the same recipe on the `cpu`
chip (its measured matrix-product rate {cpu.fp32_tflops:g} TFLOP/s; the run measured {peak:.3f} TFLOP/s as its
`perf/peak_tflops`):

{table(["phase", "metric", "measured ms", "model ms", "bound", "model / measured"], tiny_rows(measured))}

The tiny model has 2 layers of hidden 64: every phase is a few hundred MFLOP or a few hundred KiB,
which the CPU does in well under a millisecond, and the measured phases are the Python, Megatron and
shared-memory overheads of one step (a decode step of 2 layers costs milliseconds of launches, a
sync a shared-memory handshake). The model has no per-step overhead term and says so by missing
here by orders of magnitude for generation and sync; its training passes come nearer, since the
trainer's passes are long enough for the matrix products to matter. The same holds on a GPU:
`docs/gpu.md`'s `rl` tier measured 0.35 s a step for the tiny recipe on one H200, where the model
gives microseconds. The model is for steps of large models, where bytes and FLOPs dominate.

## The shipped large recipes

{chr(10).join(phase_table(name) + chr(10) for name in ("deepseek_v3", "kimi_k2", "qwen3_235b_a22b", "qwen3_30b_a3b"))}
What they say: the decode of 8,192–16,384-token responses dominates every shipped recipe (its
longest response sets each wave's length, and the MLA models read their whole latent cache on every
engine GPU); the vLLM NCCL sync of DeepSeek-V3 and Kimi-K2, the whole bf16 model through trainer
rank 0's NIC, is the second phase. `moe-rl plan recipes/deepseek_v3.yaml --sweep
cluster.rollout_nodes=8,16,32` shows what more engines buy.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="print the factors fitted on the calibration runs")
    parser.add_argument(
        "--measure", action="store_true", help="measure this CPU's matmul rate and memory bandwidth"
    )
    parser.add_argument("--write", type=Path, help="write the model's document here (docs/plan_model.md)")
    parser.add_argument(
        "--tiny-run", type=Path, help="a finished run of recipes/tiny_moe.yaml to read time/* from"
    )
    args = parser.parse_args()
    if args.measure:
        tflops, traffic, copied = measure_cpu()
        print(
            f"fp32 matmul {tflops:.3f} TFLOP/s; memory traffic {traffic:.1f} GB/s, copied {copied:.1f} GB/s"
        )
        return 0
    if args.fit:
        for name in CALIBRATIONS:
            print(f"{name}: {fit(name)}" + (" (shipped: FITTED)" if name == SHIPPED else ""))
        return 0
    if args.write:
        measured = tiny_measured(tiny_run(args.tiny_run))
        args.write.write_text(document(FITTED, measured))
        print(f"wrote {args.write}")
        return 0
    print(table(["run", "settings", "recipe", "published s", "model s", "model / published", "generation",
                 "passes", "sync", "offload"], step_rows(FITTED)))  # fmt: skip
    print()
    print(table(["refit", "published s", "model s", "model / published"], refit_rows(FITTED)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
