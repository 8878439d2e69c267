"""Routing-trace size: bytes per token of the compact codec vs int32 / int16 layouts.

Run: ``python bench/data_routing.py [--quick] [--tokens N]``.

For three MoE shapes (Qwen3-30B-A3B-like, DeepSeek-V3-like, Kimi-K2-like) it draws a synthetic
trace with skewed expert popularity (Zipf per layer, 30 % token-to-token persistence; see
``moe_rl.data.synthetic.skewed_routing``) and, as a control, a uniform one (incompressible), then
measures bytes/token for: int32 (what many frameworks ship), int16 (the published R3 figure,
768 B/token for Qwen3-30B-A3B), the compact uint8/uint16 layout, and compact + lossless
compression (zstd / lz4 through pyarrow, lzma from the standard library; layer-major or token-
major). Ratios are against int16 and int32 measured in the same process; encode / decode
throughput is given in MB/s of int16-equivalent input. The traces are synthetic: real routers
may compress better or worse.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for moe_rl

from moe_rl.data.routing import compact_routing, decode_routing, encode_routing
from moe_rl.data.synthetic import skewed_routing

MODELS = {
    "qwen3-30b-a3b-like (48L x top8 x 128E)": (48, 8, 128),
    "deepseek-v3-like   (58L x top8 x 256E)": (58, 8, 256),
    "kimi-k2-like       (60L x top8 x 384E)": (60, 8, 384),
}
VARIANTS = [  # (label, codec, layer_major, split_bytes, level)
    ("compact", "none", False, False, None),
    ("compact+lz4", "lz4", True, True, None),
    ("compact+zstd token-major", "zstd", False, False, None),
    ("compact+zstd layer-major", "zstd", True, True, None),
    ("compact+zstd-19 layer-major", "zstd", True, True, 19),
    ("compact+lzma layer-major", "lzma", True, True, None),
]


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def _uniform(num_tokens: int, layers: int, topk: int, experts: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.argsort(rng.random((num_tokens, layers, experts)), axis=-1)[..., :topk].astype(np.int32)


def bench_model(name: str, shape: tuple[int, int, int], num_tokens: int, repeat: int) -> None:
    layers, topk, experts = shape
    int32_bpt, int16_bpt = layers * topk * 4, layers * topk * 2
    print(f"\n{name}: {num_tokens} tokens; int32 {int32_bpt} B/token, int16 {int16_bpt} B/token")
    print(
        f"  {'trace':8s} {'layout':30s} {'B/token':>9s} {'x int16':>8s} {'x int32':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s}"
    )
    traces = {"skewed": skewed_routing(num_tokens, layers, topk, experts, seed=1), "uniform": None}
    traces["uniform"] = _uniform(min(num_tokens, 2048), layers, topk, experts)
    for kind, ids in traces.items():
        compact = compact_routing(ids, experts)
        tokens = ids.shape[0]
        mb16 = tokens * int16_bpt / 1e6
        for label, codec, layer_major, split, level in VARIANTS:
            if kind == "uniform" and label not in ("compact", "compact+zstd layer-major"):
                continue
            encode = functools.partial(
                encode_routing, compact, codec=codec, layer_major=layer_major, split_bytes=split, level=level
            )
            blob, enc_s = _timed(encode, 1 if level or codec == "lzma" else repeat)
            decoded, dec_s = _timed(functools.partial(decode_routing, blob), repeat)
            assert np.array_equal(decoded.numpy(), compact.numpy())
            bpt = len(blob) / tokens
            print(
                f"  {kind:8s} {label:30s} {bpt:9.1f} {bpt / int16_bpt:8.3f} {bpt / int32_bpt:8.3f} "
                f"{mb16 / enc_s:9.0f} {mb16 / dec_s:9.0f}"
            )
    per_sample = 32768 * int32_bpt / 1e6
    print(f"  (a 32K-token sample: int32 {per_sample:.1f} MB, int16 {per_sample / 2:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 tokens per model instead of 8,192")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per trace")
    args = parser.parse_args()
    num_tokens = args.tokens or (1024 if args.quick else 8192)
    for name, shape in MODELS.items():
        bench_model(name, shape, num_tokens, repeat=2 if args.quick else 3)


if __name__ == "__main__":
    main()
