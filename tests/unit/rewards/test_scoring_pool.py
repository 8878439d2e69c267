"""Reward calls at real-world cost (`moe_rl.rewards.pool` through `RewardScorer` and the reward
worker's `Rewarder`): `data.reward_workers` calls at a time in threads, processes or as coroutines;
a call past `data.reward_timeout_s` stops the run with one line naming the function, the prompt and
the cause, or scores 0 and is counted in `reward/failed`; the progress of a scoring in flight.

Concurrency is shown by behaviour, never by timing: every call waits until all of them have
started (a barrier with a deadline), which only calls running side by side get past."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from moe_rl.config.loader import load_recipe
from moe_rl.config.modes import RewardFailure, RewardPool
from moe_rl.config.schema import DataConfig
from moe_rl.data import Sample, TrajectoryBatch
from moe_rl.errors import RewardFunctionError
from moe_rl.orchestration.batches import Rewarder
from moe_rl.orchestration.dispatch import Dispatch
from moe_rl.rewards import ByteTokenizer, RewardScorer
from moe_rl.rewards.tasks import EOS, Prompt

REPO = Path(__file__).resolve().parents[3]
TOK = ByteTokenizer()
DEADLINE_S = 60.0
"""The longest a test waits for calls that should all be running, or for a scoring to end."""
_modules = itertools.count()

BARRIER = {
    # every call waits at a barrier of as many parties as calls: only calls side by side pass it
    RewardPool.THREAD: """
        import threading
        barrier = threading.Barrier({n}, timeout={deadline})
        def score(response, answer):
            barrier.wait()
            return 1.0
    """,
    # coroutines on one event loop: each waits until all have started
    "async": """
        import asyncio
        started = 0
        async def score(response, answer):
            global started
            started += 1
            async def everyone():
                while started < {n}:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(everyone(), {deadline})
            return 1.0
    """,
    # processes: each call leaves a file named by its process in the folder its answer names
    RewardPool.PROCESS: """
        import os, pathlib, time
        def score(response, answer):
            folder = pathlib.Path(answer)
            (folder / str(os.getpid())).touch()
            deadline = time.monotonic() + {deadline}
            while len(list(folder.iterdir())) < {n}:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {{len(list(folder.iterdir()))}} calls started")
                time.sleep(0.01)
            return 1.0
    """,
}

HANG = """
    import time
    def score(response, answer):
        if answer == "hang":
            time.sleep(3600)  # never returns within the test
        return float(response == answer)
"""


def _module(tmp_path: Path, monkeypatch, source: str) -> str:
    """A user reward module written to ``tmp_path`` and importable: its `module:function`."""
    name = f"user_reward_pool_{next(_modules)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:score"


def _scorer(spec: str, **keys) -> RewardScorer:
    return RewardScorer(spec, tokenizer=TOK, data=DataConfig(reward=spec, **keys))


def _prompts(answers: list[str], group_size: int) -> tuple[list[Prompt], list[list[int]]]:
    """Per response: its prompt (``group_size`` responses per answer) and a response saying "7"."""
    prompts = [Prompt(ids=tuple(TOK.encode_prompt(f"q{i}")), answer=a) for i, a in enumerate(answers)]
    per_response = [p for p in prompts for _ in range(group_size)]
    return per_response, [[*TOK.encode("7")[1:], EOS] for _ in per_response]


def _within(fn, deadline: float = DEADLINE_S):
    """``fn()``'s value (or exception), from a thread given ``deadline`` seconds to end."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), f"the scoring did not end within {deadline} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("kind", [RewardPool.THREAD, "async", RewardPool.PROCESS])
def test_calls_run_side_by_side_up_to_reward_workers(tmp_path, monkeypatch, kind):
    n = 4
    spec = _module(tmp_path, monkeypatch, BARRIER[kind].format(n=n, deadline=DEADLINE_S))
    pool = RewardPool.PROCESS if kind == RewardPool.PROCESS else RewardPool.THREAD
    scorer = _scorer(spec, reward_workers=n, reward_pool=pool)
    folder = tmp_path / "started"
    folder.mkdir()
    prompts, responses = _prompts([str(folder)], group_size=n)
    try:
        assert _within(lambda: scorer.score_batch(prompts, responses, n)).values == [1.0] * n
    finally:
        scorer.close()
    if kind == RewardPool.PROCESS:
        assert len(list(folder.iterdir())) == n  # n processes of their own


def test_one_worker_scores_one_call_at_a_time(tmp_path, monkeypatch):
    """The control of the barrier above: calls one at a time never all start together."""
    spec = _module(tmp_path, monkeypatch, BARRIER[RewardPool.THREAD].format(n=2, deadline=1))
    prompts, responses = _prompts(["7"], group_size=2)
    with pytest.raises(RewardFunctionError, match=r"raised BrokenBarrierError \(prompt 0, "):
        _within(lambda: _scorer(spec, reward_workers=1).score_batch(prompts, responses, 2))


@pytest.mark.parametrize("pool", list(RewardPool))
def test_a_hung_reward_stops_with_one_line_naming_function_prompt_and_cause(tmp_path, monkeypatch, pool):
    spec = _module(tmp_path, monkeypatch, HANG)
    scorer = _scorer(spec, reward_workers=4, reward_pool=pool, reward_timeout_s=2.0)
    prompts, responses = _prompts(["7", "hang", "7"], group_size=2)
    try:
        with pytest.raises(RewardFunctionError) as err:
            _within(lambda: scorer.score_batch(prompts, responses, 2))
    finally:
        scorer.close()
    assert str(err.value) == (
        f"reward function data.reward={spec} did not return within data.reward_timeout_s=2.0 s "
        "(prompt 1, response '7', answer 'hang')"
    )


def _rewarder(scorer: RewardScorer) -> Rewarder:
    return Rewarder(load_recipe(REPO / "recipes" / "tiny_moe.yaml", ["model.vocab_size=320"]), scorer)


def _prepare(rewarder: Rewarder, prompts: list[Prompt], responses: list[list[int]], group_size: int):
    """The reward worker's work on one replica's batch of ``responses``: shards and summary."""
    samples = [
        Sample(torch.tensor(p.ids), torch.tensor(r), torch.full((len(r),), -0.5), 0.0, i // group_size, "stop", [(0, 0)])
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]  # fmt: skip
    batch = TrajectoryBatch.from_samples(samples, engine="megatron", quant_recipe="bf16", policy_version=0)
    plan = Dispatch([list(range(len(prompts) // group_size))], group_size)
    return rewarder.prepare([batch], plan, prompts[::group_size], version=0, dp_size=1)


@pytest.mark.parametrize("pool", list(RewardPool))
def test_a_hung_reward_scores_zero_and_is_counted_in_reward_failed(tmp_path, monkeypatch, pool):
    spec = _module(tmp_path, monkeypatch, HANG)
    scorer = _scorer(
        spec, reward_workers=2, reward_pool=pool, reward_timeout_s=2.0, reward_on_failure=RewardFailure.ZERO
    )
    rewarder = _rewarder(scorer)
    prompts, responses = _prompts(["7", "hang", "8"], group_size=2)
    try:
        for _ in range(2):  # a process killed for its timeout is replaced for the next step
            _, summary = _within(lambda: _prepare(rewarder, prompts, responses, 2))
            assert summary.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
            assert summary.metrics["reward/failed"] == 2 and summary.trainable
    finally:
        rewarder.shutdown()


def test_reward_failed_is_reported_only_where_failures_score_zero(tmp_path, monkeypatch):
    spec = _module(tmp_path, monkeypatch, HANG)
    prompts, responses = _prompts(["7"], group_size=2)
    _, summary = _prepare(_rewarder(_scorer(spec)), prompts, responses, 2)
    assert "reward/failed" not in summary.metrics
    zero = _scorer(spec, reward_on_failure=RewardFailure.ZERO)
    assert _prepare(_rewarder(zero), prompts, responses, 2)[1].metrics["reward/failed"] == 0


def test_the_progress_of_a_scoring_in_flight_names_the_calls_and_the_prompt_waited_for(tmp_path, monkeypatch):
    spec = _module(tmp_path, monkeypatch, HANG)
    scorer = _scorer(spec, reward_workers=2, reward_timeout_s=30.0, reward_on_failure=RewardFailure.ZERO)
    rewarder = _rewarder(scorer)
    prompts, responses = _prompts(["7", "hang"], group_size=2)
    assert rewarder.progress() is None
    scoring = threading.Thread(target=lambda: _prepare(rewarder, prompts, responses, 2), daemon=True)
    scoring.start()
    line = None
    for _ in range(int(DEADLINE_S / 0.05)):  # until prompt 0's calls are done and prompt 1's hang
        line = rewarder.progress()
        if line is not None and line.startswith(f"data.reward={spec}: 2/4 calls done, 2 running"):
            break
        threading.Event().wait(0.05)
    assert line is not None and "the longest for" in line and "(prompt 1)" in line, line


def test_the_progress_names_the_call_running_longest_and_for_how_long():
    """`Progress.longest` is the call that started first among those still running, with the
    seconds since it started (a lower bound: they keep growing)."""
    import time

    from moe_rl.rewards.pool import Progress

    progress = Progress(total=5)
    assert progress.longest() is None
    now = time.monotonic()
    progress.running = {3: now - 7.0, 1: now - 2.0, 4: now - 0.5}  # the longest is not the least index
    index, seconds = progress.longest()
    assert index == 3 and 7.0 <= seconds < 7.0 + DEADLINE_S


DIES = """
    import os
    def score(response, answer):
        if answer == "die":
            os._exit(7)
        if answer == "raise":
            raise ValueError("no score for this")
        return float(os.getpid())
"""


def test_a_worker_process_that_dies_fails_its_call_and_a_new_one_serves_the_next(tmp_path, monkeypatch):
    """The call whose process ended says so with the exit code; a call that raised leaves its
    process serving (the same pid answers next); every call after a death gets a live process."""
    from moe_rl.rewards.pool import CallFailed, ScoringPool

    spec = _module(tmp_path, monkeypatch, DIES)
    module, name = spec.split(":")
    fn = getattr(__import__(module), name)
    pool = ScoringPool(fn, spec, RewardPool.PROCESS, workers=1, timeout_s=DEADLINE_S, timeout_cause="late")
    ok = lambda value: None  # noqa: E731
    try:
        calls = [("7", "pid"), ("7", "raise"), ("7", "pid"), ("7", "die"), ("7", "pid")]
        first, raised, again, died, after = _within(lambda: pool.run(calls, ok, stop_on_failure=False))
        assert raised.cause == "raised ValueError: no score for this" and raised.value is None
        assert again.value == first.value  # the process that raised still serves
        assert died.cause == "lost its worker process (exit code 7)" and died.value is None
        assert after.cause is None and after.value != first.value  # a new process
        assert (pool.progress.done, pool.progress.failed, pool.progress.total) == (5, 2, 5)
        with pytest.raises(CallFailed) as err:
            _within(lambda: pool.run([("7", "pid"), ("7", "die")], ok, stop_on_failure=True))
        assert (err.value.index, err.value.cause) == (1, "lost its worker process (exit code 7)")
    finally:
        pool.close()


def test_a_scoring_still_running_reports_its_progress_every_period(monkeypatch):
    """``report`` gets the phase's `Progress` every `PROGRESS_S` while calls run (here 0.05 s; the
    calls 0.4 s each, two at a time), and nothing once the phase is over; with none given, none is sent."""
    import asyncio

    from moe_rl.rewards import pool

    monkeypatch.setattr(pool, "PROGRESS_S", 0.05)

    async def slow(x):
        await asyncio.sleep(0.4)
        return x

    scoring = pool.ScoringPool(
        slow, None, RewardPool.THREAD, workers=2, timeout_s=DEADLINE_S, timeout_cause="-"
    )
    seen = []
    outcomes = scoring.run(
        [(i,) for i in range(4)], lambda v: None, False, report=lambda p: seen.append((p.total, p.done))
    )
    assert [o.value for o in outcomes] == [0, 1, 2, 3]
    assert seen and all(total == 4 for total, _ in seen), seen
    after = len(seen)
    threading.Event().wait(0.2)
    assert len(seen) == after  # the ticker ended with the phase
    assert [o.value for o in scoring.run([(5,)], lambda v: None, False)] == [5]


def _pool(tmp_path, monkeypatch, source: str, kind: RewardPool = RewardPool.PROCESS, timeout_s=DEADLINE_S):
    """A `ScoringPool` of the user function in ``source`` (imported here, and by its spec in a worker
    process), one call at a time."""
    from moe_rl.rewards.pool import ScoringPool

    spec = _module(tmp_path, monkeypatch, source)
    module, name = spec.split(":")
    return ScoringPool(
        getattr(__import__(module), name), spec, kind, workers=1, timeout_s=timeout_s, timeout_cause="late"
    )


def _causes(pool, calls: list[tuple]) -> list[str | None]:
    try:
        return [o.cause for o in _within(lambda: pool.run(calls, lambda value: None, stop_on_failure=False))]
    finally:
        pool.close()


def test_an_async_reward_that_raises_fails_its_call_a_timeout_error_of_its_own_too(tmp_path, monkeypatch):
    """What an `async def` reward raises is its call's failure, reported as raised: its own
    ``TimeoutError`` (an upstream's) too, which is not the call's time limit."""
    source = """
        async def score(kind):
            if kind == "timeout":
                raise TimeoutError("upstream gave up")
            if kind == "value":
                raise ValueError("no score")
            return 1.0
    """
    pool = _pool(tmp_path, monkeypatch, source, kind=RewardPool.THREAD)
    assert _causes(pool, [("timeout",), ("value",), ("ok",)]) == [
        "raised TimeoutError: upstream gave up", "raised ValueError: no score", None,
    ]  # fmt: skip


def test_a_reward_thread_past_its_limit_does_not_keep_the_process_from_ending(tmp_path):
    """A thread cannot be stopped: a call past its limit leaves its thread hanging, and the process
    (a run's reward worker) still ends when its work is done."""
    (tmp_path / "hangs.py").write_text("import time\ndef score(x):\n    time.sleep(3600)\n")
    code = (
        "from moe_rl.config.modes import RewardPool\n"
        "from moe_rl.rewards.pool import ScoringPool\n"
        "from hangs import score\n"
        "pool = ScoringPool(score, None, RewardPool.THREAD, workers=1, timeout_s=0.2, timeout_cause='late')\n"
        "print([o.cause for o in pool.run([(1,)], lambda v: None, False)])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert out.returncode == 0 and out.stdout.strip() == "['late']", out.stderr[-2000:]


SERVES = """
    import os, time
    if os.environ.get("REWARD_TEST_SLOW_IMPORT"):
        time.sleep(3600)  # a worker process that never gets ready
    def score(kind):
        if kind == "unpicklable":
            return lambda: 1.0
        return os.getpid()
"""


def test_a_worker_process_slower_to_start_than_its_bound_fails_the_call(tmp_path, monkeypatch):
    from moe_rl.rewards import pool as pool_module

    monkeypatch.setattr(pool_module, "STARTUP_S", 0.5)
    pool = _pool(tmp_path, monkeypatch, SERVES)
    monkeypatch.setenv("REWARD_TEST_SLOW_IMPORT", "1")  # read by the worker's import, not ours
    assert _causes(pool, [("pid",)]) == ["found no worker process ready within 0.5 s"]


def test_a_worker_process_that_cannot_import_the_function_fails_the_call_saying_so(tmp_path, monkeypatch):
    pool = _pool(tmp_path, monkeypatch, SERVES)
    module = pool.spec.split(":")[0]
    (tmp_path / f"{module}.py").unlink()  # imported here; the worker process will not find it
    (cause,) = _causes(pool, [("pid",)])
    assert cause.startswith("could not be imported in a worker process: ") and module in cause, cause


def test_a_value_a_worker_cannot_send_back_fails_its_call_and_the_worker_serves_on(tmp_path, monkeypatch):
    pool = _pool(tmp_path, monkeypatch, SERVES)
    try:
        first, unsent, after = _within(
            lambda: pool.run(
                [("pid",), ("unpicklable",), ("pid",)], lambda value: None, stop_on_failure=False
            )
        )
    finally:
        pool.close()
    assert unsent.value is None and unsent.cause.startswith("returned function, which cannot be sent back: ")
    assert after.value == first.value  # the same process


def test_an_idle_worker_process_that_ended_fails_the_next_call_saying_so(tmp_path, monkeypatch):
    """A worker process that ended between calls (killed): the call sent to it fails with its exit
    code, and the one after gets a live process."""
    import signal

    pool = _pool(tmp_path, monkeypatch, SERVES)
    try:
        (first,) = _within(lambda: pool.run([("pid",)], lambda value: None, stop_on_failure=False))
        os.kill(first.value, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S
        while psutil.Process(first.value).status() != psutil.STATUS_ZOMBIE:  # ended, not yet waited for
            assert time.monotonic() < deadline, "the worker process did not end"
            time.sleep(0.05)
        lost, after = _within(
            lambda: pool.run([("pid",), ("pid",)], lambda value: None, stop_on_failure=False)
        )
    finally:
        pool.close()
    assert lost.cause == f"lost its worker process (exit code {-signal.SIGKILL})" and lost.value is None
    assert after.cause is None and after.value != first.value


def test_a_worker_process_whose_pool_ended_ends_cleanly(tmp_path, monkeypatch):
    """Its socket closed without a kill (the pool's process ended): the worker leaves its loop and
    exits with 0, no traceback."""
    import asyncio

    from moe_rl.rewards.pool import _Worker

    spec = _module(tmp_path, monkeypatch, SERVES)
    worker = asyncio.run(_Worker(spec).started())
    worker.conn.close()
    assert worker.proc.wait(timeout=DEADLINE_S) == 0


def test_an_outcome_is_a_record_no_one_changes():
    from dataclasses import FrozenInstanceError

    from moe_rl.rewards.pool import Outcome

    with pytest.raises(FrozenInstanceError):
        Outcome(value=1.0).value = 0.0
