"""Concurrent scoring against serial scoring, for a reward that waits (a sleeping function standing
in for an LLM judge or a sandbox): the wall time of one step's scoring (`RewardScorer.score_batch`,
what the reward worker runs) with `data.reward_workers=1` (the baseline, one call at a time) and
with more workers in threads, as `async def` coroutines and in processes, in this process.

    python bench/reward_pool.py                          # 64 responses, 0.1 s per call, 16 workers
    python bench/reward_pool.py --responses 128 --sleep 0.05 --workers 32

Prints each arm's time and its speed-up over the serial baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_rl.config.modes import RewardPool  # noqa: E402
from moe_rl.config.schema import DataConfig  # noqa: E402
from moe_rl.rewards import ByteTokenizer, RewardScorer  # noqa: E402
from moe_rl.rewards.tasks import EOS, Prompt  # noqa: E402

REWARDS = """
import asyncio, time
SLEEP = {sleep}
def sleepy(response, answer):
    time.sleep(SLEEP)
    return float(response == answer)
async def sleepy_async(response, answer):
    await asyncio.sleep(SLEEP)
    return float(response == answer)
"""


def _time(spec: str, workers: int, pool: RewardPool, prompts, responses, group_size: int) -> float:
    data = DataConfig(reward=spec, reward_workers=workers, reward_pool=pool)
    scorer = RewardScorer(spec, tokenizer=ByteTokenizer(), data=data)
    try:
        if pool == RewardPool.PROCESS:  # the processes start once per run, not per step
            scorer.score_batch(prompts[:workers], responses[:workers], group_size)
        start = time.perf_counter()
        scores = scorer.score_batch(prompts, responses, group_size)
        elapsed = time.perf_counter() - start
    finally:
        scorer.close()
    assert scores.values == [1.0] * len(responses) and scores.failed == 0
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds one reward call waits")
    parser.add_argument("--workers", type=int, default=16, help="data.reward_workers of the concurrent arms")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="moe-rl-bench-reward-"))
    (folder / "bench_rewards.py").write_text(REWARDS.format(sleep=args.sleep))
    sys.path.insert(0, str(folder))  # the worker processes find it too
    tok = ByteTokenizer()
    prompts = [
        Prompt(ids=tuple(tok.encode_prompt(f"{i}+1=")), answer=str(i + 1)) for i in range(args.responses)
    ]
    prompts = [p for p in prompts[: args.responses // args.group_size] for _ in range(args.group_size)]
    responses = [[*tok.encode(str(p.answer))[1:], EOS] for p in prompts]
    common = (prompts, responses, args.group_size)
    serial = _time("bench_rewards:sleepy", 1, RewardPool.THREAD, *common)
    print(f"{args.responses} responses, {args.sleep:g} s per reward call")
    print(f"  serial (data.reward_workers=1)          {serial:7.3f} s")
    arms = [
        ("threads", "bench_rewards:sleepy", RewardPool.THREAD),
        ("async def", "bench_rewards:sleepy_async", RewardPool.THREAD),
        ("processes", "bench_rewards:sleepy", RewardPool.PROCESS),
    ]
    for name, spec, pool in arms:
        elapsed = _time(spec, args.workers, pool, *common)
        label = f"{name} (data.reward_workers={args.workers})"
        print(f"  {label:39s} {elapsed:7.3f} s   {serial / elapsed:5.1f}x faster than serial")


if __name__ == "__main__":
    main()
