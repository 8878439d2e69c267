"""Wall time of `moe-rl diagnose` on CPU: the tiny MoE, Megatron engine, 64 prompts x
rollout.group_size (8) responses, four quantization recipes.

    python bench/diagnose_wall.py                      # 64 prompts, bf16,fp8_block128,int8,int4_awq
    python bench/diagnose_wall.py --prompts 16 --quant bf16,fp8_block128

Prints the total wall time of `diagnose` (trainer build, every engine, generation, the two trainer
passes and the metrics), the split per recipe, and the headline numbers of the table. The
machine is shared (2 cores): expect noise of tens of percent between runs.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from launch.diagnose import resolve
from moe_rl.diagnostics.results import is_number
from moe_rl.diagnostics.zero_update import diagnose

log = logging.getLogger("bench.diagnose_wall")
TINY = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny_moe.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=TINY)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--quant", default="bf16,fp8_block128,int8,int4_awq")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    configs = resolve(args.recipe, args.overrides, args.quant)
    report = diagnose(configs, args.prompts, args.recipe)
    wall = time.perf_counter() - start
    n = report.num_prompts * report.responses_per_prompt
    print(f"diagnose wall time: {wall:.1f} s for {args.prompts} prompts x {report.responses_per_prompt} "
          f"responses x {len(configs)} recipes ({n} responses each), {Path(args.recipe).name}")  # fmt: skip
    for r in report.results:
        if r.unavailable is not None:
            print(f"  {r.quant:<13} {r.unavailable}")
            continue
        s = r.seconds
        cells = [(m, k) for k in ("kl_k3", "routing_agreement") for m in ("plain", "r3")]
        row = [r.modes[m].get(k) for m, k in cells]
        shown = " ".join(f"{v:.3g}" if is_number(v) else "n/a" for v in row)
        print(f"  {r.quant:<13} engine {s['engine_start_s']:5.1f} s  generate {s['generate_s']:5.1f} s  "
              f"measure {s['measure_s']:5.1f} s  | {r.counts['response_tokens']} tokens | "
              f"KL k3 plain/R3, routing plain/R3: {shown}")  # fmt: skip
    rest = wall - sum(sum(r.seconds.values()) for r in report.results)
    print(f"  trainer build, prompts, imports: {rest:.1f} s")


if __name__ == "__main__":
    main()
