"""Reward calls, many at a time, each within a time limit: the pool a step's scoring runs through
(`moe_rl.rewards.registry.RewardScorer`).

Real rewards wait (on an HTTP service, an LLM judge, a code sandbox) or compute for seconds, so a
step's calls run `data.reward_workers` at a time, coordinated by one event loop:

* an `async def` function is awaited there, its coroutines side by side;
* a plain function runs in a thread of its own per call (`RewardPool.THREAD`), or in one of the
  pool's worker processes (`RewardPool.PROCESS`), which import the function once and serve calls
  until the run ends.

A call that does not return within its time limit fails (a coroutine is cancelled, a process is
killed and replaced; a thread cannot be stopped and is left to end on its own, its answer dropped),
and so does one that raises or returns what its ``check`` refuses. `ScoringPool.run` either stops
at the first failure (`CallFailed`) or returns every call's `Outcome`. While calls run, ``report``
gets the `Progress` every `PROGRESS_S` seconds, and `ScoringPool.progress` can be read from any
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from moe_rl.config.modes import RewardPool

PROGRESS_S = 10.0
"""How often a scoring phase still running reports its progress."""
STARTUP_S = 120.0
"""The longest a worker process may take to start and import its function."""


class CallError(Exception):
    """A reward call's own account of its failure: ``cause`` ends a sentence whose subject is the
    reward ("answered HTTP 503 ..."). Any other exception a call raises is reported as raised."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


class CallFailed(Exception):
    """Call ``index`` of a run failed, and the run stops (``stop_on_failure``)."""

    def __init__(self, index: int, cause: str):
        super().__init__(f"call {index}: {cause}")
        self.index, self.cause = index, cause


@dataclass(frozen=True)
class Outcome:
    """A call's answer, or why it failed (then ``value`` is None)."""

    value: Any = None
    cause: str | None = None


@dataclass
class Progress:
    """Where a scoring phase stands: calls done (failed among them) of all, and those running with
    the time each started (`time.monotonic`)."""

    total: int
    done: int = 0
    failed: int = 0
    running: dict[int, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def longest(self) -> tuple[int, float] | None:
        """The call running longest and for how many seconds (None: none runs)."""
        running = dict(self.running)  # a copy: calls start and end in the pool's thread meanwhile
        if not running:
            return None
        index, since = min(running.items(), key=lambda item: item[1])
        return index, time.monotonic() - since


def raised(exc: BaseException) -> str:
    """Why a call that raised ``exc`` failed."""
    if isinstance(exc, CallError):
        return exc.cause
    return f"raised {type(exc).__name__}: {exc}" if str(exc) else f"raised {type(exc).__name__}"


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class ScoringPool:
    """Runs calls of ``fn`` (``spec``, `module:function`, is how a worker process imports it),
    ``workers`` at a time, each within ``timeout_s`` (None: no limit), in threads or processes as
    ``kind`` says; an `async def` ``fn`` is awaited instead. ``timeout_cause`` says why a call
    past its limit failed."""

    def __init__(
        self, fn: Callable, spec: str | None, kind: RewardPool, workers: int, timeout_s: float | None,
        timeout_cause: str,
    ):  # fmt: skip
        self.fn, self.spec, self.workers, self.timeout_s = fn, spec, workers, timeout_s
        self.timeout_cause = timeout_cause
        if _is_async(fn):
            self._call = self._await
        elif kind == RewardPool.PROCESS:
            if spec is None:
                raise ValueError("a process pool imports its function by `module:function`")
            self._call = self._in_process
        else:
            self._call = self._in_thread
        self._idle: list[_Worker] = []
        self.progress: Progress | None = None
        """The scoring phase in progress, or the last one."""

    def run(
        self, calls: Sequence[tuple], check: Callable[[Any], str | None], stop_on_failure: bool,
        report: Callable[[Progress], None] | None = None,
    ) -> list[Outcome]:  # fmt: skip
        """Every call's `Outcome`, in order: ``fn(*args)`` for each ``args`` of ``calls``, its value
        refused when ``check`` names a cause. With ``stop_on_failure`` the first failure raises
        `CallFailed` and the calls still running are given up."""
        return asyncio.run(self._run(calls, check, stop_on_failure, report))

    async def _run(self, calls, check, stop_on_failure, report) -> list[Outcome]:
        self.progress = Progress(len(calls))
        limit = asyncio.Semaphore(self.workers)
        tasks = [
            asyncio.create_task(self._one(i, args, limit, check, stop_on_failure))
            for i, args in enumerate(calls)
        ]
        ticker = asyncio.create_task(self._tick(report))
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in [*tasks, ticker]:
                task.cancel()
            await asyncio.gather(*tasks, ticker, return_exceptions=True)

    async def _one(
        self, i: int, args: tuple, limit: asyncio.Semaphore, check, stop_on_failure: bool
    ) -> Outcome:
        async with limit:
            self.progress.running[i] = time.monotonic()
            try:
                outcome = await self._outcome(args, check)
            finally:
                del self.progress.running[i]
                self.progress.done += 1
        if outcome.cause is not None:
            self.progress.failed += 1
            if stop_on_failure:
                raise CallFailed(i, outcome.cause)
        return outcome

    async def _outcome(self, args: tuple, check) -> Outcome:
        try:
            value = await self._call(args)
        except TimeoutError:
            return Outcome(cause=self.timeout_cause)
        except CallError as exc:
            return Outcome(cause=exc.cause)
        cause = check(value)
        return Outcome(None if cause else value, cause)

    async def _tick(self, report) -> None:
        while report is not None:
            await asyncio.sleep(PROGRESS_S)
            report(self.progress)

    async def _await(self, args: tuple) -> Any:
        return await asyncio.wait_for(self._guarded(args), self.timeout_s)

    async def _guarded(self, args: tuple) -> Any:
        try:
            return await self.fn(*args)
        except Exception as exc:  # the user's code: any failure is the call's (a TimeoutError too)
            raise CallError(raised(exc)) from exc

    async def _in_thread(self, args: tuple) -> Any:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def work() -> None:
            try:
                result = (True, self.fn(*args))
            except Exception as exc:  # the user's code: any failure is the call's
                result = (False, raised(exc))
            with contextlib.suppress(RuntimeError):  # the loop has closed: the call was given up
                loop.call_soon_threadsafe(_settle, answer, result)

        threading.Thread(target=work, name="reward-call", daemon=True).start()
        ok, value = await asyncio.wait_for(answer, self.timeout_s)
        if not ok:
            raise CallError(value)
        return value

    async def _in_process(self, args: tuple) -> Any:
        worker = self._idle.pop() if self._idle else await _Worker(self.spec).started()
        try:
            value = await asyncio.wait_for(worker.call(args), self.timeout_s)
        except CallError:
            if worker.alive():
                self._idle.append(worker)
            raise
        except BaseException:  # past its time limit, or the run stops: the process goes with the call
            worker.kill()
            raise
        self._idle.append(worker)
        return value

    def close(self) -> None:
        """End the worker processes."""
        while self._idle:
            self._idle.pop().kill()


def _settle(future: asyncio.Future, result: tuple) -> None:
    if not future.done():
        future.set_result(result)


class _Worker:
    """A worker process of a `RewardPool.PROCESS` pool: it imports ``spec`` once and answers one
    call at a time over a socket; it ends when the socket closes (the pool, or its process, ended)."""

    def __init__(self, spec: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # finds what we find
        code = f"from moe_rl.rewards.pool import serve; serve({spec!r}, {theirs.fileno()})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    async def started(self) -> _Worker:
        """This worker once it has imported its function (within `STARTUP_S`, apart from any
        call's time limit)."""
        try:
            await asyncio.wait_for(self._reply(), STARTUP_S)
        except BaseException as exc:
            self.kill()
            if isinstance(exc, TimeoutError):
                raise CallError(f"found no worker process ready within {STARTUP_S:g} s") from exc
            raise
        return self

    async def call(self, args: tuple) -> Any:
        try:
            self.conn.send(args)
        except OSError as exc:  # the process has ended
            self.kill()
            raise CallError(f"lost its worker process (exit code {self.proc.returncode})") from exc
        return await self._reply()

    async def _reply(self) -> Any:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self.conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(self.conn.fileno())
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.kill()
            raise CallError(f"lost its worker process (exit code {self.proc.returncode})") from exc
        if not ok:
            raise CallError(value)
        return value

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


def serve(spec: str, fd: int) -> None:
    """A worker process's loop: import ``spec``, then answer each call, `(True, value)` or
    `(False, cause)`, until the socket closes."""
    from moe_rl.rewards.functions import load_user_function

    conn = Connection(fd)
    try:
        fn = load_user_function(spec)
    except Exception as exc:  # the run names it
        conn.send((False, f"could not be imported in a worker process: {exc}"))
        return
    conn.send((True, None))  # ready
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        reply = _answer(fn, args)
        try:
            conn.send(reply)
        except Exception as exc:  # a value pickle cannot send
            conn.send((False, f"returned {type(reply[1]).__name__}, which cannot be sent back: {exc}"))


def _answer(fn: Callable, args: tuple) -> tuple[bool, Any]:
    try:
        value = fn(*args)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return True, value
    except Exception as exc:  # the user's code: any failure is the call's
        return False, raised(exc)


async def _awaited(awaitable) -> Any:
    return await awaitable
