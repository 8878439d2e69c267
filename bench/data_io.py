"""Trajectory I/O throughput: Arrow IPC shards (``moe_rl.data.shards``) vs ``torch.save``.

Run: ``python bench/data_io.py [--quick]``.

Builds one synthetic batch shaped like an RL step of a Qwen3-30B-A3B-like model (prompts 64-512
tokens, responses 256-2048, routing trace 48 layers x top-8 over 128 experts with skewed choices,
sampling masks of 1-40 kept ids per token), then measures, best of ``--repeat`` runs:
write and read MB/s of the shards with zstd / lz4 / no compression, the size on disk, and the
same for ``torch.save`` / ``torch.load`` of the batch's tensors (the baseline, same process, same
directory). MB/s is in-memory tensor bytes per second. Files are read back from the page cache,
so read figures are decode speed rather than disk speed. Also prints validate() and packing
throughput in tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for moe_rl

from moe_rl.data import TrajectoryBatch, first_difference, ragged, validate
from moe_rl.data.packing import pack_microbatches
from moe_rl.data.routing import compact_routing
from moe_rl.data.shards import read_shards, write_shards
from moe_rl.data.synthetic import skewed_routing

VOCAB = 151_936


def _mask(rng: np.random.Generator, response: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """1-40 distinct kept ids per token, the sampled one included."""
    sizes = rng.integers(1, 41, size=response.size)
    offsets = ragged.offsets_from_lengths(torch.from_numpy(sizes))
    rows = np.repeat(np.arange(response.size), sizes)
    within = np.arange(int(sizes.sum())) - np.repeat(offsets[:-1].numpy(), sizes)
    steps = np.where(within == 0, 0, rng.integers(1, 1000, size=rows.size))
    group_cumsum = np.cumsum(steps) - np.repeat(np.cumsum(steps)[offsets[:-1].numpy()], sizes)
    ids = (response[rows] + group_cumsum) % VOCAB
    return torch.from_numpy(ids.astype(np.int32)), offsets


def build_batch(num_samples: int, max_response: int, seed: int = 0) -> TrajectoryBatch:
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(64, 513, size=num_samples)
    response_len = rng.integers(256, max_response + 1, size=num_samples)
    response = rng.integers(0, VOCAB, size=int(response_len.sum()))
    trace_len = torch.from_numpy(prompt_len + response_len - 1)
    mask_ids, mask_offsets = _mask(rng, response)
    trace = skewed_routing(int(trace_len.sum()), 48, 8, 128, seed=seed)
    return TrajectoryBatch(
        prompt_ids=torch.from_numpy(rng.integers(0, VOCAB, size=int(prompt_len.sum())).astype(np.int32)),
        prompt_offsets=ragged.offsets_from_lengths(torch.from_numpy(prompt_len)),
        response_ids=torch.from_numpy(response.astype(np.int32)),
        response_offsets=ragged.offsets_from_lengths(torch.from_numpy(response_len)),
        rollout_logp=-torch.from_numpy(rng.exponential(0.3, size=response.size).astype(np.float32)),
        rewards=torch.from_numpy(rng.random(num_samples).astype(np.float32)),
        group_ids=torch.arange(num_samples) // 8,
        finish_reasons=["stop"] * num_samples,
        version_span_starts=torch.zeros(num_samples, dtype=torch.int64),
        version_span_versions=torch.full((num_samples,), 3, dtype=torch.int64),
        version_span_offsets=torch.arange(num_samples + 1),
        engine="vllm",
        quant_recipe="fp8",
        policy_version=3,
        sampling_mask_ids=mask_ids,
        sampling_mask_offsets=mask_offsets,
        routed_experts=compact_routing(trace, 128),
        routing_offsets=ragged.offsets_from_lengths(trace_len),
        num_moe_layers=48,
        num_experts=128,
        topk=8,
    )


def nbytes(batch: TrajectoryBatch) -> int:
    return sum(
        v.numel() * v.element_size()
        for v in (getattr(batch, f.name) for f in dataclasses.fields(batch))
        if isinstance(v, torch.Tensor)
    )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def best_of(
    fn: Callable[[], Any], repeat: int, setup: Callable[[], None] = lambda: None
) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        setup()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def bench_shards(
    batch: TrajectoryBatch, root: Path, compression: str | None, repeat: int
) -> tuple[float, ...]:
    out = root / f"shards-{compression}"
    _, write_s = best_of(
        lambda: write_shards([batch], out, max_samples_per_shard=16, compression=compression),
        repeat,
        setup=lambda: shutil.rmtree(out, ignore_errors=True),
    )
    chunks, read_s = best_of(lambda: list(read_shards(out)), repeat)
    assert first_difference(TrajectoryBatch.concat(chunks), batch) is None
    return write_s, read_s, dir_bytes(out)


def bench_torch_save(batch: TrajectoryBatch, root: Path, repeat: int) -> tuple[float, ...]:
    path = root / "batch.pt"
    state = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    _, write_s = best_of(lambda: torch.save(state, path), repeat)
    loaded, read_s = best_of(lambda: torch.load(path, weights_only=True), repeat)
    assert torch.equal(loaded["routed_experts"], batch.routed_experts)
    return write_s, read_s, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 samples, responses up to 512 tokens")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    num_samples, max_response = (16, 512) if args.quick else (64, 2048)
    batch = build_batch(num_samples, max_response)
    total_tokens = int(batch.sequence_lengths().sum())
    mb = nbytes(batch) / 1e6
    print(
        f"batch: {num_samples} samples, {total_tokens} tokens, {batch.num_response_tokens} response tokens, "
        f"{mb:.1f} MB in memory ({batch.routed_experts.numel() / 1e6:.1f} MB routing)"
    )
    _, val_s = best_of(lambda: validate(batch, vocab_size=VOCAB), args.repeat)
    _, pack_s = best_of(lambda: pack_microbatches(batch, 8192), args.repeat)
    print(
        f"validate: {total_tokens / val_s / 1e6:.2f} M tokens/s; pack (8K budget): {total_tokens / pack_s / 1e6:.2f} M tokens/s"
    )
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        base_w, base_r, base_size = bench_torch_save(batch, root, args.repeat)
        print(
            f"\n{'format':22s} {'write MB/s':>10s} {'read MB/s':>10s} {'MB on disk':>10s} {'write x':>8s} {'read x':>7s} {'size x':>7s}"
        )
        print(
            f"{'torch.save (baseline)':22s} {mb / base_w:10.0f} {mb / base_r:10.0f} {base_size / 1e6:10.1f} "
            f"{1.0:8.2f} {1.0:7.2f} {1.0:7.2f}"
        )
        for compression in ("zstd", "lz4", None):
            w, r, size = bench_shards(batch, root, compression, args.repeat)
            print(
                f"{'arrow-ipc ' + str(compression):22s} {mb / w:10.0f} {mb / r:10.0f} {size / 1e6:10.1f} "
                f"{base_w / w:8.2f} {base_r / r:7.2f} {size / base_size:7.2f}"
            )


if __name__ == "__main__":
    main()
